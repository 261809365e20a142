"""The agent (job master) and what it owns: its state in one place (state.py) and the parts it hands that state to,
admission, health, scaling, processes, generations, hosts, leadership and the workers file, none of which imports
the agent back; the roster of its workers; the node agents that start workers on other hosts (node_agent.py); and
the client of `elasticflow scale` (control.py).

May import every room below it: distributed/protocol.py, store/, comm/ and membership/ (the rendezvous it judges).
Nothing here is re-exported: importing control.py must not load the agent (`elasticflow status` stays light).
"""
