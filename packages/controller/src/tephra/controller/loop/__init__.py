"""The driver side: the Trainer's loop, generation ahead, the async stream, run state."""
