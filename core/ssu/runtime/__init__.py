"""Opening a kernel and running it: ``ssu.open``, the ``Kernel`` and its checked calls.

:mod:`.kernel` opens and holds the backend's callables, :mod:`.validation` and :mod:`.signatures`
check a step's inputs once per signature, :mod:`.engine_calls` binds the engines' call forms on a
kernel with the checks of :mod:`.engine_checks`.
"""
