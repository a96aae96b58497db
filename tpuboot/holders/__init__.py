"""Who holds the TPU: processes with a chip's node open, libtpu's lock files and their holders,
and what can be done about them safely (`tpuboot who`, `release`, `wait-free`, doctor's checks).

- :mod:`tpuboot.holders.procfs`: one process's facts from /proc (state, start time, user,
  command line, its systemd unit or container, PID namespace, memlock limit, capabilities);
- :mod:`tpuboot.holders.scan`: one pass over /proc/*/fd, matching device nodes by number and path;
- :mod:`tpuboot.holders.locks`: libtpu's lock files and who holds them (/proc/locks);
- :mod:`tpuboot.holders.report`: the chips, their holders and the locks, as `who` shows them;
- :mod:`tpuboot.holders.release`: removing unheld lock files, ending holders when asked;
- :mod:`tpuboot.holders.wait`: waiting until every chip and lock is free.
"""
