"""`make bench`: the daemon's figures measured side by side with the floors, in one run.

Not a test: nothing here asserts a time. See docs/performance.md for the results
and how to read them.
"""
