"""Scheduling: the inference workers and their batching rounds, admission of streams and files onto
them, measured capacity, lateness, and the event loop's handle on each job."""
