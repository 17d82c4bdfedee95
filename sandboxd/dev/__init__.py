"""The tool developer's loop behind `sandboxd run`: an ephemeral sandbox and a file watcher."""
