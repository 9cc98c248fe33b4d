"""posttrain-example-plugin: a third-party plugin written from docs/plugin-guide.md alone."""

__version__ = "0.1.0"
