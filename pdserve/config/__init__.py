"""Typed settings, one class per component, each knob spelled once: the YAML schema, the
`pdserve serve` flags and the engine read the same fields. Imports no torch."""
