"""Facts about the operating system, read without side effects: cgroup CPU quotas, usable CPUs, OpenMP
runtimes loaded in this process. Imports nothing else of mplaunch."""
