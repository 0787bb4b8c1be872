"""Every record and encoding that crosses a process or file boundary: safetensors layout, the agent's wire
protocol, the small state without pickle, item names, checkpoint path shapes. Typed, versioned, validated on
decode.

May import: common.
"""
