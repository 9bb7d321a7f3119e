"""The memory lab: measure how a linear-attention model writes, keeps and reads a fact.

```python
import linmem.memory as mm
mm.heads(model)                                      # [Component(layer, head, "S"|"R"), ...]
logits = mm.run(model, recipient_ids, donor_ids, edits=[mm.StateSwap([(3, 1, "S")], at=40)])
mm.contributions(model, ids, layer=3, head=1, t=40)   # [41, V, K], sums to mm.state(model, ids, 3, 1, 40)
```
See ``docs/memory.md``.

The names below load with their module on first use (``linmem.io.lazy``), so that ``linmem probe --help`` does not
import torch.
"""

from linmem.io.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "linmem.memory.components": ("Component", "attention_layers", "conv_width", "heads", "layers",
                                 "recurrent_layers"),
    "linmem.memory.decompose": ("contributions", "state"),
    "linmem.memory.edits": ("CacheSwap", "DonorWrite", "Edit", "KeyAlign", "OutputPatch", "OutputRestore", "StateAdd",
                            "StateSwap", "WriteBlock"),
    "linmem.memory.intervene": ("run", "run_many"),
    "linmem.memory.recording": ("Recording",),
})
