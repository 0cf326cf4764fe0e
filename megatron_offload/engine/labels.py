"""Labels of the engine's ordering calls, one per copy-protocol rule it implements.

Devices receive them with every wait, record and synchronization: real devices ignore them,
the checked device names them in its reports, and a negative control drops exactly the
calls of one label (``CheckedDevice(skip_labels=...)``). The rule numbers refer to the
protocol in ``protocol.py``.
"""

D2H_AFTER_WRITERS = "d2h-after-writers"  # rule 1
D2H_AFTER_USERS = "d2h-after-users"  # rule 1 (the step ran on a stream other than the caller's)
D2H_RECORD_STREAM = "d2h-record-stream"  # rule 2
USE_RECORD_STREAM = "use-record-stream"  # rule 2 (memory used on a stream it was not regrown on)
H2D_AFTER_ALLOCATION = "h2d-after-allocation"  # rule 7 (the regrown block's earlier users)
H2D_AFTER_D2H = "h2d-after-d2h"  # rule 5 (the host copy is complete before it is read)
USE_AFTER_H2D = "use-after-h2d"  # rules 3 and 4
HOST_READ_AFTER_D2H = "host-read-after-d2h"  # rule 5
WRITE_AFTER_D2H = "write-after-d2h"  # rule 2 (memory kept in place is not rewritten under its D2H)
USER_AFTER_D2H = "user-after-d2h"  # the same, for a user stream other than the reloading one
HOST_FREE_AFTER_COPIES = "host-free-after-copies"  # rule 5 (no copy uses a freed host arena)
SLOT_REUSE_AFTER_D2H = "slot-reuse-after-d2h"  # a slot is refilled only after its D2H read it
