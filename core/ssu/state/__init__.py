"""State caches the built-in backends share and any backend may build on.

The versioned-slot layout, allocated or adopted, and its commit (:mod:`.slot_state`,
:mod:`.slot_kernels`), 8-bit rows with their scales (:mod:`.quant`), and the device-side record of
guarded slot ids (:mod:`.faults`).
"""
