"""The benchmark harness: scenarios, runs, faults, results, plots, reports, regression, the CLI.

A user of the emulator library (`emulator/`) and of the node-side trainers (`trainers/`); neither
imports it.
"""
