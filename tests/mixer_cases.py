"""The model variants every model-level test suite runs on: each mixer, and an RDN hybrid with attention."""

MIXER_CASES = {
    "sgla": dict(mixer="sgla"),
    "gla": dict(mixer="gla"),
    "gdn": dict(mixer="gdn"),
    "rla": dict(mixer="rla"),
    "rdn": dict(mixer="rdn"),
    "rdn_hybrid": dict(mixer="rdn", num_hidden_layers=3, attn_layers=[1], attn_num_heads=4, attn_num_kv_heads=2),
}
