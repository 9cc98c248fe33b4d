"""Built-in plugins: registered before third-party ones, overridable where marked ``trylast``."""
