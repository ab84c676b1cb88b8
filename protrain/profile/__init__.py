"""Profiles: what the cost models know about the model (ModelProfile: measured by
``protrain.measure.profiler.profile_model`` or estimated by ``analytic.analytic_profile``) and
the machine (HardwareProfile: measured by ``protrain.measure.probe.probe_hardware`` or
published in ``machines``). Values only: nothing here runs the runtime or imports it."""
