"""A save in the trainer (save steps 1-4 and 8): lease, agreement, plan, staging the copies into node memory,
the hand-over to the agent, the PEC bookkeeping and the planned exit's last save.

May import: common, format, integrity, pec, store, memory, configuration, agent.
"""
