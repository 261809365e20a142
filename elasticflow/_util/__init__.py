"""Leaf helpers: files, paths, the console, environment names, signals, core affinity, sealed records, memory,
and the process's training context. They import nothing of elasticflow but ``errors`` and each other."""
