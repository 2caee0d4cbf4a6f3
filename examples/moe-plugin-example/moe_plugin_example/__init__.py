"""moe-plugin-example: a complete, minimal third-party moe-core plugin (experts backend ``simple``)."""

__version__ = "0.1.0"
