"""Reads a run's log only: step re-execution, mismatch/staleness/routing analysis, bisect, compare,
simulate, reports, log tools.

Imports bus/ and runtime's core.
"""
