"""Measuring and tuning a kernel: GPU timing, the bytes a step must move, shared tuning files.

GPU timing as the project reports it (:mod:`.timing`), the traffic floor of a step
(:mod:`.traffic`), and files that the processes tuning one cache update together (:mod:`.files`).
"""
