"""Weight sync in three parts: export (trainer hook), transport (here), import (rollout hook)."""
