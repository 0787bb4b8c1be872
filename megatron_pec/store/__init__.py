"""The storage seam (`Storage`: POSIX, object stores through MSC) and one checkpoint directory's layout:
generations, node markers, the manifest commit, the tracker, retention.

May import: common, format, integrity.
"""
