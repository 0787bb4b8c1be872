"""A restore in the trainer (load steps 3-7): what each rank can read, the agreed iteration, sources read and
verified, the decision, applying it and checking where it landed, resharding from storage.

May import: common, format, integrity, pec, store, memory, configuration, agent.
"""
