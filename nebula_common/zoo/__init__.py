"""Models and datasets that ship with Nebula's built-in jobs, shared by more than one of them.

Why apart from ``nebula_common.jobspec``: the jobspec package is the contract every
user job is held to (the spec and the stage program API); this package is only
ordinary code that some stage modules happen to import, exactly as a user's
stage module may import its own libraries. Nothing here knows about the runtime.
"""
