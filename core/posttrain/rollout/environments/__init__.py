"""Multi-turn episodes: environments and tools as plugins, and the driver's episode runner."""
