"""The ``lchat`` command line: the operator's tool for one box's registry (docs/design.md §3).

Synchronous on purpose: it writes registry rows, env files and units, then asks the running router
to reload over its admin socket; network work runs on a reactor of its own (:mod:`.runner`).
"""
