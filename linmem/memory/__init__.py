"""The memory lab: measure how a linear-attention model writes, keeps and reads a fact.

```python
import linmem.memory as mm
mm.heads(model)                                      # [Component(layer, head, "S"|"R"), ...]
logits = mm.run(model, recipient_ids, donor_ids, edits=[mm.StateSwap([(3, 1, "S")], at=40)])
mm.contributions(model, ids, layer=3, head=1, t=40)   # [41, V, K], sums to mm.state(model, ids, 3, 1, 40)
```
See ``docs/memory.md``.
"""

from linmem.memory.components import Component, attention_layers, conv_width, heads, layers, recurrent_layers
from linmem.memory.decompose import contributions, state
from linmem.memory.edits import (
    CacheSwap,
    DonorWrite,
    Edit,
    KeyAlign,
    OutputPatch,
    OutputRestore,
    StateAdd,
    StateSwap,
    WriteBlock,
)
from linmem.memory.intervene import run, run_many
from linmem.memory.recording import Recording

__all__ = [
    "CacheSwap", "Component", "DonorWrite", "Edit", "KeyAlign", "OutputPatch", "OutputRestore", "Recording", "StateAdd",
    "StateSwap", "WriteBlock", "attention_layers", "contributions", "conv_width", "heads", "layers",
    "recurrent_layers", "run", "run_many", "state",
]
