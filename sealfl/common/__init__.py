"""Code shared by two or more sealfl components (HE codec, array framing, errors)."""
