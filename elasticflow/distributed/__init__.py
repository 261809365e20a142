"""Elastic data parallelism: agent.py (job master), membership.py (worker side), comm.py (collectives)."""
