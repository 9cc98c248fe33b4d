"""The hook markers, on the ground floor: any module may import them without importing what the
hook specifications name (:mod:`posttrain.hookspecs` sits above the packages whose types its
signatures use)."""

import pluggy

# Marks a hook specification (posttrain.hookspecs only).
hookspec = pluggy.HookspecMarker("posttrain")
# Marks a plugin's implementation of a hook (re-exported as ``posttrain.hookimpl``).
hookimpl = pluggy.HookimplMarker("posttrain")
