"""2. Plan and launch: which roles share rank processes, starting them (local processes or Ray
actors), and the calls the driver makes on every rank.

Every launcher returns :class:`~posttrain.launch.base.WorkerGroup` objects with the same methods,
so the loop does not know whether ranks are local processes or Ray actors."""
