"""One typed configuration, loaded from YAML, then SANDBOXD_* variables, then flags.

Precedence (last wins): defaults < YAML file < environment < command-line flags.
A key in a section is named ``SANDBOXD_<SECTION>_<KEY>`` in the environment,
e.g. ``SANDBOXD_POOL_MAX_PER_USER=8``. Unknown keys and bad values stop
start-up with the key's name. Every key is documented in docs/config.md.

One concern a module: ``defaults`` (paths and shared values), ``sections`` (calls, pool,
sandbox, egress, integrations, metrics), ``storage`` (the disk quota), ``model`` (the whole
``Config`` and its cross-section checks), ``load`` (file, environment, flags), ``keys``
(each key's env name, and what a reload applies). Import from here: ``from sandboxd.config import X``.
"""

from sandboxd.config.defaults import (AUTO_SANDBOX_ID, BRIDGE_NETWORK, DEFAULT_ALLOWED_ENV, DEFAULT_EMAIL_DB,
                                      DEFAULT_NETWORK, EMAIL_DB_NAME, REPO_ROOT, RUNNER_IMAGE, SYSTEM_CONFIG,
                                      UNSAFE_NAMES, UnsafeName, checkout, default_data_path, default_seed_tools,
                                      default_socket_path)
from sandboxd.config.cluster import ClusterConfig, ClusterTLS
from sandboxd.config.keys import LIVE_KEYS, RESTART_KEYS, flatten, iter_keys, needs_restart
from sandboxd.config.load import config_file, env_keys, load_config
from sandboxd.config.model import Config, check_unsandboxed, email_db_path, unsafe_settings
from sandboxd.config.sections import (CallsConfig, EgressConfig, IntegrationsConfig, MetricsConfig, PoolConfig,
                                      SandboxConfig, ToolsConfig, parse_listen_address, shim_line_bytes)
from sandboxd.config.storage import Enforcement, StorageConfig, UserQuota, parse_size
from sandboxd.errors import ConfigError

__all__ = [
    "AUTO_SANDBOX_ID", "BRIDGE_NETWORK", "DEFAULT_ALLOWED_ENV", "DEFAULT_EMAIL_DB", "DEFAULT_NETWORK", "EMAIL_DB_NAME",
    "LIVE_KEYS", "REPO_ROOT", "RESTART_KEYS", "RUNNER_IMAGE", "SYSTEM_CONFIG", "UNSAFE_NAMES",
    "CallsConfig", "ClusterConfig", "ClusterTLS", "Config", "ConfigError", "EgressConfig", "Enforcement", "IntegrationsConfig", "MetricsConfig",
    "PoolConfig", "SandboxConfig", "StorageConfig", "ToolsConfig", "UnsafeName", "UserQuota",
    "check_unsandboxed", "checkout", "config_file", "default_data_path", "default_seed_tools", "default_socket_path",
    "email_db_path", "env_keys", "flatten", "iter_keys", "load_config", "needs_restart", "parse_listen_address",
    "parse_size", "shim_line_bytes", "unsafe_settings",
]
