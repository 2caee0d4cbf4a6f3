"""moe-core conformance kit (issue 4): a pytest plugin certifying any backend against the reference."""
