// SPDX-License-Identifier: GPL-2.0-only
/*
 * cgpu_km: the GPU-sharing control tree in procfs, /proc/cgpu_km.
 *
 * The contract (nodes, modes, values, errno) is docs/design.md, "The
 * control tree"; where it is silent this module follows the Python state
 * model cgpu_km/tree/model.py, which the FUSE tree serves.  The node table comes
 * from cgpu_km/tree/nodes.py through the generated cgpu_km_nodes.h.
 *
 * Layout: one proc directory per object (root, GPU, container) and one
 * proc_create_data() per node.  Every node's proc data is a struct cgpu_leaf
 * embedded in its object, naming the node's table entry and the object.
 * All value nodes share one proc_ops (one show, one write keyed by the
 * table); inst_ctl has its own write.
 *
 * Locking and lifetime:
 * - cgpu.lock (mutex) guards every value, the container lists and the
 *   per-process usage.  Handlers take it for a whole read or write, so a
 *   read is a consistent snapshot and a failed write changes nothing.
 * - cgpu.ctl_lock serialises the structure: inst_ctl commands, which create
 *   and remove container directories.  It is never taken by value handlers.
 * - proc_remove() waits for handlers running on the removed entries, so an
 *   object is freed only after its entries are removed.  It is never called
 *   with cgpu.lock held (a handler waiting for that lock would deadlock it):
 *   a container is unlinked and marked dead under cgpu.lock, then its
 *   directory is removed, then it is freed.  A handler that reaches a dead
 *   container in between answers -ENOENT; once the entry is removed, procfs
 *   itself answers -EIO to files still open.
 */

#define pr_fmt(fmt) KBUILD_MODNAME ": " fmt

#include <linux/ctype.h>
#include <linux/fs.h>
#include <linux/kernel.h>
#include <linux/list.h>
#include <linux/module.h>
#include <linux/mutex.h>
#include <linux/proc_fs.h>
#include <linux/seq_file.h>
#include <linux/slab.h>
#include <linux/sort.h>
#include <linux/string.h>
#include <linux/uaccess.h>
#include <linux/version.h>

#include "cgpu_km_nodes.h"

#if LINUX_VERSION_CODE < KERNEL_VERSION(5, 6, 0)
#error "cgpu_km needs Linux 5.6 or newer (struct proc_ops)"
#endif
#if LINUX_VERSION_CODE < KERNEL_VERSION(5, 17, 0)
#define pde_data(inode) PDE_DATA(inode)
#endif

#define CGPU_PID_MAX 2147483647ULL

struct cgpu_gpu;
struct cgpu_ctr;

/* The proc data of one node: its table entry and the objects it belongs to. */
struct cgpu_leaf {
	const struct cgpu_node_def *def;
	struct cgpu_gpu *gpu;	/* NULL at the root */
	struct cgpu_ctr *ctr;	/* NULL above containers */
};

struct cgpu_proc_use {
	u64 pid;
	u64 bytes;
	unsigned int seq;	/* position in the command, for last-wins */
};

struct cgpu_ctr {
	struct list_head link;		/* in gpu->ctrs, under cgpu.lock */
	struct cgpu_gpu *gpu;
	bool live;			/* linked into the tree */
	char name[CGPU_ID_MAX_LEN + 1];
	u64 ident;
	u64 val[CGPU_CONTAINER_SLOTS];
	struct cgpu_proc_use *procs;	/* sorted by pid */
	unsigned int nprocs;
	struct proc_dir_entry *dir;
	struct cgpu_leaf leaf[CGPU_CONTAINER_NODES];
};

struct cgpu_gpu {
	unsigned int index;
	u64 val[CGPU_GPU_SLOTS];
	u64 total_memory;
	struct list_head ctrs;
	unsigned int nctrs;
	struct proc_dir_entry *dir;
	struct cgpu_leaf leaf[CGPU_GPU_NODES];
};

static struct {
	struct mutex lock;
	struct mutex ctl_lock;
	bool unloading;			/* under ctl_lock */
	u64 val[CGPU_ROOT_SLOTS];
	u64 next_ident;
	struct cgpu_gpu *gpus;
	unsigned int ngpus;
	dev_t devt;
	struct proc_dir_entry *dir;
	struct cgpu_leaf leaf[CGPU_ROOT_NODES];
} cgpu;

/*
 * Module parameters.  -1 (the default) means the node table's initial
 * value, which is then written back so that sysfs shows what is in force.
 */
static unsigned int gpus = 1;
module_param(gpus, uint, 0444);
MODULE_PARM_DESC(gpus, CGPU_PARM_DESC_GPUS);
static int policy = -1;
module_param(policy, int, 0444);
MODULE_PARM_DESC(policy, CGPU_PARM_DESC_POLICY);
static int max_inst = -1;
module_param(max_inst, int, 0444);
MODULE_PARM_DESC(max_inst, CGPU_PARM_DESC_MAX_INST);
static int prio_ratio = -1;
module_param(prio_ratio, int, 0444);
MODULE_PARM_DESC(prio_ratio, CGPU_PARM_DESC_PRIO_RATIO);
static unsigned long long gpu_mem[CGPU_MAX_GPUS];
static int gpu_mem_count;
module_param_array(gpu_mem, ullong, &gpu_mem_count, 0444);
MODULE_PARM_DESC(gpu_mem, "total memory of each GPU in bytes, for meminfo's Free of whole-device containers");

/* ---- parsing: pure functions, no tree state -------------------------- */

/*
 * The contract's whitespace, around values and between command words:
 * " \t\n\v\f\r" and nothing else (the kernel's isspace() also takes 0xa0;
 * Python's str.split() takes 0x1c..0x1f too).
 */
static bool cgpu_is_space(char c)
{
	return c == ' ' || (c >= '\t' && c <= '\r');
}

/*
 * Parse a NUL-terminated run of ASCII decimal digits.  -EINVAL when it is
 * empty or holds anything else (a sign, "0x"), -ERANGE above U64_MAX.
 */
static int cgpu_parse_digits(const char *s, u64 *value)
{
	const char *p;

	if (!*s)
		return -EINVAL;
	for (p = s; *p; p++)
		if (!isdigit(*p))
			return -EINVAL;
	return kstrtou64(s, 10, value);
}

/* One value write: digits with optional surrounding whitespace; buf is writable. */
static int cgpu_parse_value(char *buf, size_t len, u64 *value)
{
	size_t start = 0;
	int err;

	while (len > start && cgpu_is_space(buf[len - 1]))
		len--;
	while (start < len && cgpu_is_space(buf[start]))
		start++;
	if (memchr(buf + start, '\0', len - start))
		return -EINVAL;
	buf[len] = '\0';
	err = cgpu_parse_digits(buf + start, value);
	return err == -ERANGE ? -EINVAL : err;
}

static bool cgpu_valid_id(const char *name)
{
	size_t len = strlen(name), i;

	if (len < 1 || len > CGPU_ID_MAX_LEN)
		return false;
	for (i = 0; i < len; i++)
		if (!isalnum(name[i]) && !strchr("_.-", name[i]))
			return false;
	if (!strcmp(name, ".") || !strcmp(name, ".."))
		return false;
	/* A GPU-level node's name would shadow that file. */
	for (i = 0; i < CGPU_NODE_COUNT; i++)
		if (cgpu_nodes[i].level == CGPU_LEVEL_GPU && !strcmp(cgpu_nodes[i].name, name))
			return false;
	return true;
}

enum cgpu_verb { CGPU_ADD, CGPU_DEL, CGPU_MEMINFO };

/* The options of add: each sets the container node of the same name. */
enum cgpu_option { CGPU_OPT_MEMSIZE, CGPU_OPT_WEIGHT, CGPU_OPT_HIGHPRIO, CGPU_OPT_UTIL_LIMIT,
		   CGPU_OPTIONS };
static const enum cgpu_node_id cgpu_option_nodes[CGPU_OPTIONS] = {
	[CGPU_OPT_MEMSIZE] = CGPU_NODE_MEMSIZE,
	[CGPU_OPT_WEIGHT] = CGPU_NODE_WEIGHT,
	[CGPU_OPT_HIGHPRIO] = CGPU_NODE_HIGHPRIO,
	[CGPU_OPT_UTIL_LIMIT] = CGPU_NODE_UTIL_LIMIT,
};

struct cgpu_cmd {
	enum cgpu_verb verb;
	bool all_gpus;			/* del/-<id> without a GPU */
	u64 gpu;			/* U64_MAX when the number overflowed */
	char name[CGPU_ID_MAX_LEN + 1];
	bool has_option[CGPU_OPTIONS];
	u64 option[CGPU_OPTIONS];
	struct cgpu_proc_use *procs;	/* meminfo: sorted by pid, unique */
	unsigned int nprocs;
};

static int cgpu_parse_gpu(const char *s, u64 *gpu)
{
	int err = cgpu_parse_digits(s, gpu);

	if (err == -ERANGE) {
		*gpu = U64_MAX;	/* a number, just no such GPU: ENODEV later */
		return 0;
	}
	return err;
}

static int cgpu_set_name(struct cgpu_cmd *cmd, const char *name)
{
	if (!cgpu_valid_id(name))
		return -EINVAL;
	strscpy(cmd->name, name, sizeof(cmd->name));
	return 0;
}

/* Split "key=value" in place; -EINVAL without '='. */
static int cgpu_split_pair(char *token, char **value)
{
	char *eq = strchr(token, '=');

	if (!eq)
		return -EINVAL;
	*eq = '\0';
	*value = eq + 1;
	return 0;
}

static int cgpu_parse_options(struct cgpu_cmd *cmd, char **tok, unsigned int n)
{
	unsigned int i, k;

	for (i = 0; i < n; i++) {
		const struct cgpu_node_def *def = NULL;
		char *value;
		u64 v;

		if (cgpu_split_pair(tok[i], &value))
			return -EINVAL;
		for (k = 0; k < CGPU_OPTIONS; k++)
			if (!strcmp(tok[i], cgpu_nodes[cgpu_option_nodes[k]].name))
				break;
		if (k == CGPU_OPTIONS || cmd->has_option[k])
			return -EINVAL;	/* unknown or repeated */
		def = &cgpu_nodes[cgpu_option_nodes[k]];
		if (cgpu_parse_digits(value, &v))
			return -EINVAL;
		/* A max of max_inst is checked once the GPU is known. */
		if (v < def->min || (!def->max_is_max_inst && v > def->max))
			return -EINVAL;
		cmd->has_option[k] = true;
		cmd->option[k] = v;
	}
	return 0;
}

static int cgpu_cmp_proc_use(const void *a, const void *b)
{
	const struct cgpu_proc_use *x = a, *y = b;

	if (x->pid != y->pid)
		return x->pid < y->pid ? -1 : 1;
	return x->seq < y->seq ? -1 : (x->seq > y->seq);
}

/*
 * "<pid>=<bytes> ..." into cmd->procs, sorted by pid.  A key repeated
 * verbatim is -EINVAL; different spellings of one pid ("1", "01"): the
 * last one wins, as in the state model.
 */
static int cgpu_parse_procs(struct cgpu_cmd *cmd, char **tok, unsigned int n)
{
	struct cgpu_proc_use *use;
	char **key;
	unsigned int i, end, out;
	int err = -EINVAL;

	if (!n)
		return 0;
	use = kcalloc(n, sizeof(*use), GFP_KERNEL);
	key = kcalloc(n, sizeof(*key), GFP_KERNEL);
	if (!use || !key) {
		err = -ENOMEM;
		goto out;
	}
	for (i = 0; i < n; i++) {
		char *value;

		if (cgpu_split_pair(tok[i], &value))
			goto out;
		key[i] = tok[i];
		if (cgpu_parse_digits(key[i], &use[i].pid) ||
		    cgpu_parse_digits(value, &use[i].bytes) ||
		    use[i].pid < 1 || use[i].pid > CGPU_PID_MAX)
			goto out;
		use[i].seq = i;
	}
	sort(use, n, sizeof(*use), cgpu_cmp_proc_use, NULL);
	for (i = 0, out = 0; i < n; i = end) {
		unsigned int a, b;

		for (end = i + 1; end < n && use[end].pid == use[i].pid; end++)
			;
		for (a = i; a < end; a++)
			for (b = a + 1; b < end; b++)
				if (!strcmp(key[use[a].seq], key[use[b].seq]))
					goto out;
		use[out++] = use[end - 1];	/* the last spelling wins */
	}
	cmd->procs = use;
	cmd->nprocs = out;
	use = NULL;
	err = 0;
out:
	kfree(use);
	kfree(key);
	return err;
}

/*
 * Parse one inst_ctl write (NUL-terminated at buf[len]) into cmd.  Every
 * syntax error is -EINVAL, found before anything is looked up.
 */
static int cgpu_parse_command(char *buf, size_t len, struct cgpu_cmd *cmd)
{
	char **tok;
	unsigned int n = 0;
	size_t i;
	int err = -EINVAL;

	for (i = 0; i < len; i++)
		if (buf[i] == '\0' || (unsigned char)buf[i] >= 0x80)
			return -EINVAL;	/* not ASCII text */
	tok = kcalloc(len / 2 + 1, sizeof(*tok), GFP_KERNEL);
	if (!tok)
		return -ENOMEM;
	for (i = 0; i < len; i++) {
		if (cgpu_is_space(buf[i])) {
			buf[i] = '\0';
		} else if (i == 0 || buf[i - 1] == '\0') {
			tok[n++] = &buf[i];
		}
	}
	if (!n)
		goto out;

	if (!strcmp(tok[0], "add") && n >= 3) {
		cmd->verb = CGPU_ADD;
		err = cgpu_parse_gpu(tok[1], &cmd->gpu) ?:
		      cgpu_set_name(cmd, tok[2]) ?:
		      cgpu_parse_options(cmd, tok + 3, n - 3);
	} else if (!strcmp(tok[0], "del") && (n == 2 || n == 3)) {
		cmd->verb = CGPU_DEL;
		cmd->all_gpus = n == 2;
		err = (n == 3 ? cgpu_parse_gpu(tok[1], &cmd->gpu) : 0) ?:
		      cgpu_set_name(cmd, tok[n - 1]);
	} else if (!strcmp(tok[0], "meminfo") && n >= 3) {
		cmd->verb = CGPU_MEMINFO;
		err = cgpu_parse_gpu(tok[1], &cmd->gpu) ?:
		      cgpu_set_name(cmd, tok[2]) ?:
		      cgpu_parse_procs(cmd, tok + 3, n - 3);
	} else if (n == 1 && tok[0][0] == '-') {
		cmd->verb = CGPU_DEL;
		cmd->all_gpus = true;
		err = cgpu_set_name(cmd, tok[0] + 1);
	} else if (n == 1 && strlen(tok[0]) == 1 + CGPU_LEGACY_ID_LEN && isdigit(tok[0][0])) {
		cmd->verb = CGPU_ADD;
		cmd->gpu = tok[0][0] - '0';
		err = cgpu_set_name(cmd, tok[0] + 1);
	}
out:
	kfree(tok);
	return err;
}

/* ---- the tree: everything below runs under cgpu.lock unless noted ----- */

static struct cgpu_ctr *cgpu_find(struct cgpu_gpu *gpu, const char *name)
{
	struct cgpu_ctr *ctr;

	list_for_each_entry(ctr, &gpu->ctrs, link)
		if (!strcmp(ctr->name, name))
			return ctr;
	return NULL;
}

static u64 cgpu_weight_sum(const struct cgpu_gpu *gpu, const struct cgpu_ctr *excluding)
{
	const struct cgpu_ctr *ctr;
	u64 sum = 0;

	list_for_each_entry(ctr, &gpu->ctrs, link)
		if (ctr != excluding)
			sum += ctr->val[CGPU_CONTAINER_WEIGHT];
	return sum;
}

static u64 cgpu_free_weight(const struct cgpu_gpu *gpu)
{
	return gpu->val[CGPU_GPU_MAX_INST] - cgpu_weight_sum(gpu, NULL);
}

static u64 *cgpu_slot(const struct cgpu_leaf *leaf)
{
	switch (leaf->def->level) {
	case CGPU_LEVEL_ROOT:
		return &cgpu.val[leaf->def->slot];
	case CGPU_LEVEL_GPU:
		return &leaf->gpu->val[leaf->def->slot];
	case CGPU_LEVEL_CONTAINER:
		break;
	}
	return &leaf->ctr->val[leaf->def->slot];
}

static u64 cgpu_value(const struct cgpu_leaf *leaf)
{
	switch (leaf->def - cgpu_nodes) {
	case CGPU_NODE_FREE_WEIGHT:
		return cgpu_free_weight(leaf->gpu);
	case CGPU_NODE_MAJOR:
		return MAJOR(cgpu.devt);
	case CGPU_NODE_ID:
		return leaf->ctr->ident;
	}
	return *cgpu_slot(leaf);
}

/* Range, then the node's own rule (null_blk's apply hook), then store. */
static int cgpu_store(const struct cgpu_leaf *leaf, u64 value)
{
	const struct cgpu_node_def *def = leaf->def;
	u64 max = def->max_is_max_inst ? leaf->gpu->val[CGPU_GPU_MAX_INST] : def->max;

	if (value < def->min || value > max)
		return -EINVAL;
	switch (def - cgpu_nodes) {
	case CGPU_NODE_WEIGHT:
		if (cgpu_weight_sum(leaf->gpu, leaf->ctr) + value > max)
			return -ENOSPC;
		break;
	case CGPU_NODE_MAX_INST:
		if (value < leaf->gpu->nctrs || value < cgpu_weight_sum(leaf->gpu, NULL))
			return -EBUSY;
		break;
	}
	*cgpu_slot(leaf) = value;
	return 0;
}

static void cgpu_show_meminfo(struct seq_file *m, const struct cgpu_ctr *ctr)
{
	u64 limit = ctr->val[CGPU_CONTAINER_MEMSIZE] ?: ctr->gpu->total_memory;
	u64 used = 0;
	unsigned int i;

	for (i = 0; i < ctr->nprocs; i++)
		if (check_add_overflow(used, ctr->procs[i].bytes, &used))
			used = U64_MAX;	/* above any limit: Free is 0 */
	seq_printf(m, "Free: %llu\n", limit > used ? limit - used : 0);
	for (i = 0; i < ctr->nprocs; i++)
		seq_printf(m, "PID: %llu Mem: %llu\n", ctr->procs[i].pid, ctr->procs[i].bytes);
}

/* ---- proc handlers (they take the locks) --------------------------------- */

static bool cgpu_leaf_dead(const struct cgpu_leaf *leaf)
{
	return leaf->ctr && !leaf->ctr->live;
}

static int cgpu_show(struct seq_file *m, void *v)
{
	const struct cgpu_leaf *leaf = m->private;
	int err = 0;

	mutex_lock(&cgpu.lock);
	if (cgpu_leaf_dead(leaf)) {
		err = -ENOENT;
		goto out;
	}
	switch (leaf->def->kind) {
	case CGPU_KIND_VERSION:
		seq_puts(m, CGPU_KM_VERSION "\n");
		break;
	case CGPU_KIND_COMMAND:
		seq_puts(m, CGPU_INST_CTL_USAGE);
		break;
	case CGPU_KIND_MEMINFO:
		cgpu_show_meminfo(m, leaf->ctr);
		break;
	case CGPU_KIND_VALUE:
	case CGPU_KIND_DERIVED:
		seq_printf(m, "%llu\n", cgpu_value(leaf));
		break;
	}
out:
	mutex_unlock(&cgpu.lock);
	return err;
}

static int cgpu_open(struct inode *inode, struct file *file)
{
	return single_open(file, cgpu_show, pde_data(inode));
}

static ssize_t cgpu_write(struct file *file, const char __user *ubuf, size_t count,
			  loff_t *ppos)
{
	const struct cgpu_leaf *leaf = pde_data(file_inode(file));
	char buf[CGPU_VALUE_WRITE_MAX + 1];
	u64 value;
	int err;

	if (!(leaf->def->mode & 0200))
		return -EPERM;
	if (count > CGPU_VALUE_WRITE_MAX)
		return -EINVAL;
	if (copy_from_user(buf, ubuf, count))
		return -EFAULT;
	err = cgpu_parse_value(buf, count, &value);
	if (err)
		return err;
	mutex_lock(&cgpu.lock);
	err = cgpu_leaf_dead(leaf) ? -ENOENT : cgpu_store(leaf, value);
	mutex_unlock(&cgpu.lock);
	return err ?: count;
}

static const struct proc_ops cgpu_node_ops = {
	.proc_open = cgpu_open,
	.proc_read_iter = seq_read_iter,
	.proc_lseek = seq_lseek,
	.proc_release = single_release,
	.proc_write = cgpu_write,
};

static ssize_t cgpu_inst_ctl_write(struct file *file, const char __user *ubuf,
				   size_t count, loff_t *ppos);

static const struct proc_ops cgpu_inst_ctl_ops = {
	.proc_open = cgpu_open,
	.proc_read_iter = seq_read_iter,
	.proc_lseek = seq_lseek,
	.proc_release = single_release,
	.proc_write = cgpu_inst_ctl_write,
};

/* Create the node files of one directory; the caller removes dir on failure. */
static int cgpu_create_leaves(struct proc_dir_entry *dir, enum cgpu_level level,
			      struct cgpu_leaf *leaf, struct cgpu_gpu *gpu,
			      struct cgpu_ctr *ctr)
{
	unsigned int i;

	for (i = 0; i < CGPU_NODE_COUNT; i++) {
		const struct cgpu_node_def *def = &cgpu_nodes[i];
		const struct proc_ops *ops = def->kind == CGPU_KIND_COMMAND ?
					     &cgpu_inst_ctl_ops : &cgpu_node_ops;

		if (def->level != level)
			continue;
		*leaf = (struct cgpu_leaf){ .def = def, .gpu = gpu, .ctr = ctr };
		if (!proc_create_data(def->name, S_IFREG | def->mode, dir, ops, leaf))
			return -ENOMEM;
		leaf++;
	}
	return 0;
}

static void cgpu_free_ctr(struct cgpu_ctr *ctr)
{
	kfree(ctr->procs);
	kfree(ctr);
}

/* Called without cgpu.lock: allocate a container and its (not yet live) directory. */
static struct cgpu_ctr *cgpu_new_ctr(struct cgpu_gpu *gpu, const char *name)
{
	struct cgpu_ctr *ctr = kzalloc(sizeof(*ctr), GFP_KERNEL);

	if (!ctr)
		return NULL;
	ctr->gpu = gpu;
	strscpy(ctr->name, name, sizeof(ctr->name));
	INIT_LIST_HEAD(&ctr->link);
	ctr->dir = proc_mkdir(name, gpu->dir);
	if (!ctr->dir ||
	    cgpu_create_leaves(ctr->dir, CGPU_LEVEL_CONTAINER, ctr->leaf, gpu, ctr)) {
		proc_remove(ctr->dir);
		kfree(ctr);
		return NULL;
	}
	return ctr;
}

/* The checks of add, in the state model's order; under cgpu.lock. */
static int cgpu_add_check(const struct cgpu_cmd *cmd, struct cgpu_gpu **gpu)
{
	if (cmd->gpu >= cgpu.ngpus)
		return -ENODEV;
	*gpu = &cgpu.gpus[cmd->gpu];
	if (cmd->has_option[CGPU_OPT_WEIGHT] &&
	    cmd->option[CGPU_OPT_WEIGHT] > (*gpu)->val[CGPU_GPU_MAX_INST])
		return -EINVAL;
	if (cgpu_find(*gpu, cmd->name))
		return -EEXIST;
	if ((*gpu)->nctrs >= (*gpu)->val[CGPU_GPU_MAX_INST])
		return -ENOSPC;
	return 0;
}

/* A name already on another GPU keeps its instance id; ids are never reused. */
static u64 cgpu_ident_for(const char *name)
{
	struct cgpu_ctr *other;
	unsigned int g;

	for (g = 0; g < cgpu.ngpus; g++) {
		other = cgpu_find(&cgpu.gpus[g], name);
		if (other)
			return other->ident;
	}
	return cgpu.next_ident++;
}

static void cgpu_link(struct cgpu_gpu *gpu, struct cgpu_ctr *ctr, const struct cgpu_cmd *cmd)
{
	u64 *val = ctr->val;
	unsigned int k;

	for (k = 0; k < CGPU_OPTIONS; k++)
		val[cgpu_nodes[cgpu_option_nodes[k]].slot] = cmd->has_option[k] ?
			cmd->option[k] : cgpu_nodes[cgpu_option_nodes[k]].initial;
	if (!cmd->has_option[CGPU_OPT_MEMSIZE])
		val[CGPU_CONTAINER_MEMSIZE] = cgpu.val[CGPU_ROOT_DEFAULT_MEMSIZE];
	val[CGPU_CONTAINER_WEIGHT] = min(val[CGPU_CONTAINER_WEIGHT], cgpu_free_weight(gpu));
	ctr->ident = cgpu_ident_for(ctr->name);
	list_add_tail(&ctr->link, &gpu->ctrs);
	gpu->nctrs++;
	ctr->live = true;
}

/* Under ctl_lock. */
static int cgpu_add(const struct cgpu_cmd *cmd)
{
	struct cgpu_gpu *gpu;
	struct cgpu_ctr *ctr;
	int err;

	mutex_lock(&cgpu.lock);
	err = cgpu_add_check(cmd, &gpu);
	mutex_unlock(&cgpu.lock);
	if (err)
		return err;
	ctr = cgpu_new_ctr(gpu, cmd->name);
	if (!ctr)
		return -ENOMEM;
	/* max_inst or weights may have changed meanwhile: check again. */
	mutex_lock(&cgpu.lock);
	err = cgpu_add_check(cmd, &gpu);
	if (!err)
		cgpu_link(gpu, ctr, cmd);
	mutex_unlock(&cgpu.lock);
	if (err) {
		proc_remove(ctr->dir);
		cgpu_free_ctr(ctr);
	}
	return err;
}

/* Under ctl_lock. */
static int cgpu_del(const struct cgpu_cmd *cmd)
{
	struct cgpu_ctr *ctr, *tmp;
	unsigned int g;
	LIST_HEAD(doomed);
	int err = 0;

	mutex_lock(&cgpu.lock);
	if (!cmd->all_gpus && cmd->gpu >= cgpu.ngpus) {
		err = -ENODEV;
	} else {
		for (g = 0; g < cgpu.ngpus; g++) {
			if (!cmd->all_gpus && g != cmd->gpu)
				continue;
			ctr = cgpu_find(&cgpu.gpus[g], cmd->name);
			if (!ctr)
				continue;
			ctr->live = false;
			list_move_tail(&ctr->link, &doomed);
			cgpu.gpus[g].nctrs--;
		}
		if (list_empty(&doomed))
			err = -ENOENT;
	}
	mutex_unlock(&cgpu.lock);
	list_for_each_entry_safe(ctr, tmp, &doomed, link) {
		proc_remove(ctr->dir);
		cgpu_free_ctr(ctr);
	}
	return err;
}

/* Under ctl_lock; takes cmd->procs on success. */
static int cgpu_meminfo(struct cgpu_cmd *cmd)
{
	struct cgpu_proc_use *old = NULL;
	struct cgpu_ctr *ctr;
	int err = 0;

	mutex_lock(&cgpu.lock);
	if (cmd->gpu >= cgpu.ngpus) {
		err = -ENODEV;
	} else {
		ctr = cgpu_find(&cgpu.gpus[cmd->gpu], cmd->name);
		if (!ctr) {
			err = -ENOENT;
		} else {
			old = ctr->procs;
			ctr->procs = cmd->procs;
			ctr->nprocs = cmd->nprocs;
			cmd->procs = NULL;
		}
	}
	mutex_unlock(&cgpu.lock);
	kfree(old);
	return err;
}

static ssize_t cgpu_inst_ctl_write(struct file *file, const char __user *ubuf,
				   size_t count, loff_t *ppos)
{
	struct cgpu_cmd *cmd;
	char *buf;
	int err;

	if (count > CGPU_COMMAND_WRITE_MAX)
		return -EINVAL;
	buf = memdup_user_nul(ubuf, count);
	if (IS_ERR(buf))
		return PTR_ERR(buf);
	cmd = kzalloc(sizeof(*cmd), GFP_KERNEL);
	err = cmd ? cgpu_parse_command(buf, count, cmd) : -ENOMEM;
	if (!err) {
		mutex_lock(&cgpu.ctl_lock);
		if (cgpu.unloading)
			err = -ENODEV;
		else if (cmd->verb == CGPU_ADD)
			err = cgpu_add(cmd);
		else if (cmd->verb == CGPU_DEL)
			err = cgpu_del(cmd);
		else
			err = cgpu_meminfo(cmd);
		mutex_unlock(&cgpu.ctl_lock);
	}
	if (cmd)
		kfree(cmd->procs);
	kfree(cmd);
	kfree(buf);
	return err ?: count;
}

/* ---- module load and unload ------------------------------------------- */

static int cgpu_initial(int *param, enum cgpu_node_id id, u64 *value)
{
	const struct cgpu_node_def *def = &cgpu_nodes[id];

	if (*param == -1)
		*param = def->initial;
	if (*param < 0 || *param < def->min || *param > def->max) {
		pr_err("%s=%d is outside %llu..%llu\n", def->name, *param, def->min, def->max);
		return -EINVAL;
	}
	*value = *param;
	return 0;
}

static void cgpu_free_tree(void)
{
	struct cgpu_ctr *ctr, *tmp;
	unsigned int g;

	for (g = 0; g < cgpu.ngpus; g++)
		list_for_each_entry_safe(ctr, tmp, &cgpu.gpus[g].ctrs, link)
			cgpu_free_ctr(ctr);
	kfree(cgpu.gpus);
	cgpu.gpus = NULL;
}

static int cgpu_create_gpus(void)
{
	unsigned int g;
	char name[8];
	int err;

	for (g = 0; g < cgpu.ngpus; g++) {
		struct cgpu_gpu *gpu = &cgpu.gpus[g];

		snprintf(name, sizeof(name), "%u", g);
		gpu->dir = proc_mkdir(name, cgpu.dir);
		if (!gpu->dir)
			return -ENOMEM;
		err = cgpu_create_leaves(gpu->dir, CGPU_LEVEL_GPU, gpu->leaf, gpu, NULL);
		if (err)
			return err;
	}
	return 0;
}

static int __init cgpu_init(void)
{
	u64 initial[CGPU_GPU_SLOTS] = {};
	unsigned int g, i;
	int err;

	if (gpus < 1 || gpus > CGPU_MAX_GPUS) {
		pr_err("gpus=%u is outside 1..%d\n", gpus, CGPU_MAX_GPUS);
		return -EINVAL;
	}
	err = cgpu_initial(&policy, CGPU_NODE_POLICY, &initial[CGPU_GPU_POLICY]) ?:
	      cgpu_initial(&max_inst, CGPU_NODE_MAX_INST, &initial[CGPU_GPU_MAX_INST]) ?:
	      cgpu_initial(&prio_ratio, CGPU_NODE_PRIO_RATIO, &initial[CGPU_GPU_PRIO_RATIO]);
	if (err)
		return err;

	mutex_init(&cgpu.lock);
	mutex_init(&cgpu.ctl_lock);
	cgpu.unloading = false;
	cgpu.next_ident = 1;
	for (i = 0; i < CGPU_NODE_COUNT; i++)
		if (cgpu_nodes[i].level == CGPU_LEVEL_ROOT && cgpu_nodes[i].kind == CGPU_KIND_VALUE)
			cgpu.val[cgpu_nodes[i].slot] = cgpu_nodes[i].initial;
	cgpu.ngpus = gpus;
	cgpu.gpus = kcalloc(gpus, sizeof(*cgpu.gpus), GFP_KERNEL);
	if (!cgpu.gpus)
		return -ENOMEM;
	for (g = 0; g < gpus; g++) {
		cgpu.gpus[g].index = g;
		memcpy(cgpu.gpus[g].val, initial, sizeof(initial));
		cgpu.gpus[g].total_memory = g < gpu_mem_count ? gpu_mem[g] : 0;
		INIT_LIST_HEAD(&cgpu.gpus[g].ctrs);
	}

	err = alloc_chrdev_region(&cgpu.devt, 0, gpus, KBUILD_MODNAME);
	if (err)
		goto free_tree;
	cgpu.dir = proc_mkdir(KBUILD_MODNAME, NULL);
	if (!cgpu.dir) {
		err = -ENOMEM;
		goto unregister;
	}
	err = cgpu_create_leaves(cgpu.dir, CGPU_LEVEL_ROOT, cgpu.leaf, NULL, NULL) ?:
	      cgpu_create_gpus();
	if (err)
		goto remove;
	pr_info("version %s, %u GPUs, major %d\n", CGPU_KM_VERSION, gpus, MAJOR(cgpu.devt));
	return 0;

remove:
	proc_remove(cgpu.dir);
unregister:
	unregister_chrdev_region(cgpu.devt, gpus);
free_tree:
	cgpu_free_tree();
	return err;
}

static void __exit cgpu_exit(void)
{
	/* No inst_ctl command is half-way through once this lock is ours. */
	mutex_lock(&cgpu.ctl_lock);
	cgpu.unloading = true;
	mutex_unlock(&cgpu.ctl_lock);
	proc_remove(cgpu.dir);	/* waits for every running handler */
	unregister_chrdev_region(cgpu.devt, cgpu.ngpus);
	cgpu_free_tree();
}

module_init(cgpu_init);
module_exit(cgpu_exit);

MODULE_LICENSE("GPL");
MODULE_AUTHOR("cgpu_km authors");
MODULE_DESCRIPTION("GPU-sharing control tree at /proc/cgpu_km");
MODULE_VERSION(CGPU_KM_VERSION);
