"""Loading a workflow file: parsed, structured into config's typed sections and checked, every
mistake reported at once before anything starts. It sits above the phases whose settings it
checks (config/ below only declares the sections)."""
