"""The plugin host: finding and loading plugins, the strategies they declare, the modules a
workflow names, and the environment checks of ``posttrain doctor``."""
