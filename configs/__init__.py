"""Model presets for KT_CONFIG (``*.yaml``) and the demo's settings (``tiny-demo.env``).

Edited here, at the top of the source tree; the build ships this folder inside the
package as ``vllm_kt_plugin.configs`` (pyproject.toml: package-dir), so presets resolve
from a wheel as from a checkout."""
