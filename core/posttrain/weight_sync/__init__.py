"""8. Weight sync: export (a trainer's hook), transport (in process, shared memory, broadcast) and
import (a rollout engine's hook), and the phase on the driver that runs them."""
