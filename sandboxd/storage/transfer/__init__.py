"""One user as a unit: their files, own tools and email database as one archive, and back (`sandboxd users export/import`).

manifest.py says what an archive holds and checks it; tarstream.py writes and reads the
tar framing itself (a few header kinds, nothing else); export.py takes a consistent
snapshot of a user and streams it; importer.py fills a staging folder from a stream it
trusts in nothing and renames it into place only when every byte is checked.
"""
