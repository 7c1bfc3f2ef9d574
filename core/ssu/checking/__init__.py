"""What a backend is checked against: the float64 oracle, realistic inputs, the harnesses.

The float64 statement of the math, realistic random inputs (never zeros), and the harnesses that
drive a backend (its step, and the engines' call forms) beside the reference or the oracle.
"""
