"""Launchers start each role's worker group and carry calls to its ranks.

Every launcher returns :class:`WorkerGroup` objects with the same methods, so the loop does not
know whether ranks are local processes or Ray actors.
"""
