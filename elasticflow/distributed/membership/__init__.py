"""A worker's side of the job: joining with the token, heartbeating, following the agent's generations and building
each one's group (membership.py), and the rendezvous records that say when a generation formed (rendezvous.py,
which the agent reads too).

May import distributed/protocol.py, store/ and comm/; never agent/.
"""
