"""Measuring: the code that runs the model or runtime pieces to fill in the profile values
(protrain/profile/). ``profiler.profile_model`` traces one training iteration -> ModelProfile;
``probe.probe_hardware`` times copies, Adam kernels and storage on this machine ->
HardwareProfile (with ``update_overhead``, the runtime's own time per offloaded chunk update);
``heap_peak`` checks memory figures against real allocations. It stands above the runtime
(it builds Streams, chunk managers, optimizers and storage backends); nothing below imports it."""
