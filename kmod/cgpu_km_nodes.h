/* SPDX-License-Identifier: GPL-2.0-only */
/*
 * The control tree's node table, generated from cgpu_km/tree/nodes.py by
 * `python -m cgpu_km.tree.kmod_header kmod/cgpu_km_nodes.h`. Do not edit:
 * tests/kmod/test_header.py fails when this file is stale.
 */
#ifndef CGPU_KM_NODES_H
#define CGPU_KM_NODES_H

#include <linux/types.h>

#define CGPU_KM_VERSION "0.1.0"
#define CGPU_ID_MAX_LEN 64
#define CGPU_LEGACY_ID_LEN 12
#define CGPU_VALUE_WRITE_MAX 64
#define CGPU_COMMAND_WRITE_MAX 4096
#define CGPU_MAX_GPUS 16
#define CGPU_INST_CTL_USAGE "usage: <g><id12> | -<id> | add <gpu> <id> [memsize=B] [weight=W] [highprio=0|1] [util_limit=P] | del [<gpu>] <id> | meminfo <gpu> <id> [<pid>=<bytes> ...]\n"

/* MODULE_PARM_DESC of the module parameters. */
#define CGPU_PARM_DESC_GPUS "number of GPU directories, 1..16 (default 1)"
#define CGPU_PARM_DESC_POLICY "initial policy of every GPU, 0..5 (default 1)"
#define CGPU_PARM_DESC_MAX_INST "initial max_inst of every GPU, 1..25 (default 16)"
#define CGPU_PARM_DESC_PRIO_RATIO "initial prio_ratio of every GPU, 20..99 (default 80)"

enum cgpu_level {
	CGPU_LEVEL_ROOT,
	CGPU_LEVEL_GPU,
	CGPU_LEVEL_CONTAINER,
};

enum cgpu_kind {
	CGPU_KIND_VALUE,
	CGPU_KIND_DERIVED,
	CGPU_KIND_VERSION,
	CGPU_KIND_COMMAND,
	CGPU_KIND_MEMINFO,
};

enum cgpu_node_id {
	CGPU_NODE_VERSION,
	CGPU_NODE_DEFAULT_MEMSIZE,
	CGPU_NODE_INST_CTL,
	CGPU_NODE_UPGRADE,
	CGPU_NODE_POLICY,
	CGPU_NODE_MAX_INST,
	CGPU_NODE_PRIO_RATIO,
	CGPU_NODE_FREE_WEIGHT,
	CGPU_NODE_MAJOR,
	CGPU_NODE_ID,
	CGPU_NODE_MEMSIZE,
	CGPU_NODE_MEMINFO,
	CGPU_NODE_WEIGHT,
	CGPU_NODE_HIGHPRIO,
	CGPU_NODE_UTIL_LIMIT,
	CGPU_NODE_COUNT,
};

/* Nodes in each root directory, and its stored values. */
#define CGPU_ROOT_NODES 4
enum cgpu_root_slot {
	CGPU_ROOT_DEFAULT_MEMSIZE,
	CGPU_ROOT_UPGRADE,
	CGPU_ROOT_SLOTS,
};

/* Nodes in each gpu directory, and its stored values. */
#define CGPU_GPU_NODES 5
enum cgpu_gpu_slot {
	CGPU_GPU_POLICY,
	CGPU_GPU_MAX_INST,
	CGPU_GPU_PRIO_RATIO,
	CGPU_GPU_SLOTS,
};

/* Nodes in each container directory, and its stored values. */
#define CGPU_CONTAINER_NODES 6
enum cgpu_container_slot {
	CGPU_CONTAINER_MEMSIZE,
	CGPU_CONTAINER_WEIGHT,
	CGPU_CONTAINER_HIGHPRIO,
	CGPU_CONTAINER_UTIL_LIMIT,
	CGPU_CONTAINER_SLOTS,
};

struct cgpu_node_def {
	const char *name;
	enum cgpu_level level;
	enum cgpu_kind kind;
	umode_t mode;
	int slot;		/* index into the level's values; -1 unless a VALUE */
	u64 min;
	u64 max;
	bool max_is_max_inst;	/* max is the GPU's current max_inst */
	u64 initial;
};

static const struct cgpu_node_def cgpu_nodes[CGPU_NODE_COUNT] = {
	[CGPU_NODE_VERSION] = {
		.name = "version",
		.level = CGPU_LEVEL_ROOT,
		.kind = CGPU_KIND_VERSION,
		.mode = 0444,
		.slot = -1,
		.min = 0ULL,
		.max = 0ULL,
		.max_is_max_inst = false,
		.initial = 0ULL,
	},
	[CGPU_NODE_DEFAULT_MEMSIZE] = {
		.name = "default_memsize",
		.level = CGPU_LEVEL_ROOT,
		.kind = CGPU_KIND_VALUE,
		.mode = 0644,
		.slot = CGPU_ROOT_DEFAULT_MEMSIZE,
		.min = 0ULL,
		.max = 18446744073709551615ULL,
		.max_is_max_inst = false,
		.initial = 0ULL,
	},
	[CGPU_NODE_INST_CTL] = {
		.name = "inst_ctl",
		.level = CGPU_LEVEL_ROOT,
		.kind = CGPU_KIND_COMMAND,
		.mode = 0600,
		.slot = -1,
		.min = 0ULL,
		.max = 0ULL,
		.max_is_max_inst = false,
		.initial = 0ULL,
	},
	[CGPU_NODE_UPGRADE] = {
		.name = "upgrade",
		.level = CGPU_LEVEL_ROOT,
		.kind = CGPU_KIND_VALUE,
		.mode = 0644,
		.slot = CGPU_ROOT_UPGRADE,
		.min = 0ULL,
		.max = 1ULL,
		.max_is_max_inst = false,
		.initial = 0ULL,
	},
	[CGPU_NODE_POLICY] = {
		.name = "policy",
		.level = CGPU_LEVEL_GPU,
		.kind = CGPU_KIND_VALUE,
		.mode = 0644,
		.slot = CGPU_GPU_POLICY,
		.min = 0ULL,
		.max = 5ULL,
		.max_is_max_inst = false,
		.initial = 1ULL,
	},
	[CGPU_NODE_MAX_INST] = {
		.name = "max_inst",
		.level = CGPU_LEVEL_GPU,
		.kind = CGPU_KIND_VALUE,
		.mode = 0644,
		.slot = CGPU_GPU_MAX_INST,
		.min = 1ULL,
		.max = 25ULL,
		.max_is_max_inst = false,
		.initial = 16ULL,
	},
	[CGPU_NODE_PRIO_RATIO] = {
		.name = "prio_ratio",
		.level = CGPU_LEVEL_GPU,
		.kind = CGPU_KIND_VALUE,
		.mode = 0644,
		.slot = CGPU_GPU_PRIO_RATIO,
		.min = 20ULL,
		.max = 99ULL,
		.max_is_max_inst = false,
		.initial = 80ULL,
	},
	[CGPU_NODE_FREE_WEIGHT] = {
		.name = "free_weight",
		.level = CGPU_LEVEL_GPU,
		.kind = CGPU_KIND_DERIVED,
		.mode = 0444,
		.slot = -1,
		.min = 0ULL,
		.max = 0ULL,
		.max_is_max_inst = false,
		.initial = 0ULL,
	},
	[CGPU_NODE_MAJOR] = {
		.name = "major",
		.level = CGPU_LEVEL_GPU,
		.kind = CGPU_KIND_DERIVED,
		.mode = 0444,
		.slot = -1,
		.min = 0ULL,
		.max = 0ULL,
		.max_is_max_inst = false,
		.initial = 0ULL,
	},
	[CGPU_NODE_ID] = {
		.name = "id",
		.level = CGPU_LEVEL_CONTAINER,
		.kind = CGPU_KIND_DERIVED,
		.mode = 0444,
		.slot = -1,
		.min = 0ULL,
		.max = 0ULL,
		.max_is_max_inst = false,
		.initial = 0ULL,
	},
	[CGPU_NODE_MEMSIZE] = {
		.name = "memsize",
		.level = CGPU_LEVEL_CONTAINER,
		.kind = CGPU_KIND_VALUE,
		.mode = 0644,
		.slot = CGPU_CONTAINER_MEMSIZE,
		.min = 1ULL,
		.max = 18446744073709551615ULL,
		.max_is_max_inst = false,
		.initial = 0ULL,
	},
	[CGPU_NODE_MEMINFO] = {
		.name = "meminfo",
		.level = CGPU_LEVEL_CONTAINER,
		.kind = CGPU_KIND_MEMINFO,
		.mode = 0444,
		.slot = -1,
		.min = 0ULL,
		.max = 0ULL,
		.max_is_max_inst = false,
		.initial = 0ULL,
	},
	[CGPU_NODE_WEIGHT] = {
		.name = "weight",
		.level = CGPU_LEVEL_CONTAINER,
		.kind = CGPU_KIND_VALUE,
		.mode = 0644,
		.slot = CGPU_CONTAINER_WEIGHT,
		.min = 0ULL,
		.max = 0ULL,
		.max_is_max_inst = true,
		.initial = 1ULL,
	},
	[CGPU_NODE_HIGHPRIO] = {
		.name = "highprio",
		.level = CGPU_LEVEL_CONTAINER,
		.kind = CGPU_KIND_VALUE,
		.mode = 0644,
		.slot = CGPU_CONTAINER_HIGHPRIO,
		.min = 0ULL,
		.max = 1ULL,
		.max_is_max_inst = false,
		.initial = 0ULL,
	},
	[CGPU_NODE_UTIL_LIMIT] = {
		.name = "util_limit",
		.level = CGPU_LEVEL_CONTAINER,
		.kind = CGPU_KIND_VALUE,
		.mode = 0644,
		.slot = CGPU_CONTAINER_UTIL_LIMIT,
		.min = 0ULL,
		.max = 95ULL,
		.max_is_max_inst = false,
		.initial = 0ULL,
	},
};

#endif /* CGPU_KM_NODES_H */
