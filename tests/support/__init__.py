"""Support code shared by test modules, so that no test module imports another.

* ``servers``: real services (auth, switch) run in-process on a private event loop;
* ``accounts``: the bootstrap admin password, auth settings for in-process servers, and accounts on a
  running two-cluster deployment;
* ``jobs``: the built-in ``numbers`` job (encoder in cluster a, decoder in b) with spec fields overridden;
* PKI fixtures live in ``tests/conftest.py`` because pytest injects them by name.
"""
