"""What every layer needs from the operating system, below everything else: folders written whole (`files`), child
processes that end with their owner (`lifetime`), HTTP request bodies bounded (`http_limits`), an event loop in a
thread for sync code that drives async clients (`background`), listening sockets for in-process servers (`tcp`)."""
