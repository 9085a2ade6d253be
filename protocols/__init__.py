"""Swarm protocols of compute islands: the Streaming DiLoCo core and the records islands share.

"protocols" here means swarm protocols, not typing interfaces.

Glossary
--------
step       one inner optimizer step of an island (counted from 1).
window     H consecutive steps; each fragment is averaged once per window.
fragment   one of P strided parameter groups: block i belongs to fragment i mod P,
           the embeddings to fragment 0, the final norm and head to fragment P-1.
offset     o_p = floor(p * H / P): the step within a window at which fragment p's round starts.
overlap    tau: the number of steps between a round's start and the application of its result.
round      one averaging of one fragment across islands; round r of fragment p starts
           at step r * H + o_p (r >= 1).
global     a fragment's last agreed values (fp32, on CPU).
local      the values the island is training.
pseudo-gradient  delta_p = global_p - local_p, the island's contribution to a round.
outer step       Nesterov SGD on the averaged pseudo-gradient, applied to global_p.
mixing     local_p <- alpha * local_p + (1 - alpha) * global_p after the outer step.
island, satellite  the roles of a node; a satellite is in contact only at times.

The pure modules (fragments, schedule, outer, diloco, manifest) read no clocks,
sockets or globals and import no asyncio or hivemind; tests guard that.
"""

PROTOCOL_VERSION = 1
