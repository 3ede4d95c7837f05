"""Planning before launch: memory, remedies, time and cost, checkpoint interval, local or remote."""
