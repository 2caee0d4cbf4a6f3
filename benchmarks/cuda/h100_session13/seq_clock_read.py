import sys, re, datetime
out = sys.argv[1]
log = open(f"{out}/seq_clock.log").read().splitlines()
smi = []
for line in open(f"{out}/seq_smi.csv"):
    p = [x.strip() for x in line.split(",")]
    t = datetime.datetime.strptime(p[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
    smi.append((t, p[1], p[2], p[3], p[4]))
start = None
for line in log:
    m = re.match(r"=== run (\d) start ([\d.]+)", line)
    if m:
        start = float(m.group(2)); continue
    m = re.match(r"\s+\[(\d+)/\d+\]\s+(\d+)s (\S+)\s+\S+\s+(\S+)\s+T=(\d+)\s+([\d.]+) us", line)
    if m and m.group(3) == "qwen3-30b-a3b" and m.group(5) in ("4096", "16384", "1024"):
        t_end = start + int(m.group(2))
        win = [s for s in smi if t_end - 2.0 <= s[0] <= t_end + 1.0]
        print(line.strip(), "| smi in [end-2 s, end+1 s]:", [(s[1], s[2], s[3]) for s in win[::4]])
