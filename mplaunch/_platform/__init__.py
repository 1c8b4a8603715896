"""Facts about the operating system (cgroups, ``/proc``, OpenMP runtimes). Imports nothing else of mplaunch."""
