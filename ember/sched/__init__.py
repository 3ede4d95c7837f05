"""The local service: a queue of training jobs, packed onto this machine's devices, stepping
aside for the owner and for local inference (`ember serve`)."""
