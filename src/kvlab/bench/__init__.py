"""Benchmarks behind `kvlab bench`: they print tables and write bench/results/*.json."""
