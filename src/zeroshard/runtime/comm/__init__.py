"""Communication: every collective through one gate, recorded and fingerprinted; the
comm context that orders collectives against compute; int8 quantized collectives."""
