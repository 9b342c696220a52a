/*
 * efabus libfabric shim. libfabric's data-path API is static inline over
 * function tables, so Rust cannot call it directly: each function here is
 * one call, with no policy of its own, but for loading libfabric itself at
 * its first use (below). See shim.h for the structs.
 */
#define _GNU_SOURCE /* dlvsym */
#include <dlfcn.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_rma.h>
#include <rdma/fi_eq.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_ext.h>

#include "shim.h"

/* The API version efabus is written against; 2.x libraries honour it. */
#define EFABUS_FI_VERSION FI_VERSION(1, 17)

#ifdef EFABUS_FI_HEADER_MAJOR
_Static_assert(FI_MAJOR_VERSION == EFABUS_FI_HEADER_MAJOR &&
		       FI_MINOR_VERSION == EFABUS_FI_HEADER_MINOR,
	       "these headers are not those of the libfabric build.rs found");
#endif

#ifdef EFABUS_FI_INFO_ABI
/*
 * libfabric is loaded at the first call that needs it, not with the
 * process (build.rs says why). Its exported functions are looked up at the
 * symbol versions a program linked against these headers would bind.
 */
#define FI_LIBRARY "libfabric.so.1"

static struct {
	int (*getinfo)(uint32_t, const char *, const char *, uint64_t,
		       const struct fi_info *, struct fi_info **);
	void (*freeinfo)(struct fi_info *);
	struct fi_info *(*dupinfo)(const struct fi_info *);
	int (*fabric)(struct fi_fabric_attr *, struct fid_fabric **, void *);
	const char *(*strerror)(int);
	char *(*tostr_r)(char *, size_t, const void *, enum fi_type);
	uint32_t (*version)(void);
} lib;
static pthread_once_t lib_once = PTHREAD_ONCE_INIT;
static char lib_error[512];
/* Set (release) once the library is loaded and its functions found. */
static int lib_ready;

#define FI(name) (lib.name)

/* Why loading failed (EFABUS_FI_NOT_FOUND or EFABUS_FI_TOO_OLD, 0 if it
 * did not), with the text in lib_error. */
static int lib_failure;

static void *try_open(const char *file, int flags)
{
	void *handle = dlopen(file, flags);
	size_t used = strlen(lib_error);
	const char *why;

	if (handle || used + 3 >= sizeof(lib_error))
		return handle;
	why = dlerror();
	snprintf(lib_error + used, sizeof(lib_error) - used, "%s%s",
		 used ? "; " : "", why ? why : file);
	return handle;
}

/*
 * A libfabric the process has loaded already (an embedding program's own)
 * is used as it is. Otherwise EFABUS_LIBFABRIC names the file, and then
 * only it is tried; else the build's directory (for a prefix such as
 * /opt/amazon/efa), then the loader's search (LD_LIBRARY_PATH).
 */
static void *open_library(const char **opened)
{
	const char *chosen = getenv("EFABUS_LIBFABRIC");
	void *handle = dlopen(FI_LIBRARY, RTLD_NOW | RTLD_NOLOAD);

	*opened = FI_LIBRARY;
	if (handle)
		return handle;
	if (chosen && chosen[0]) {
		*opened = chosen;
		return try_open(chosen, RTLD_NOW | RTLD_LOCAL);
	}
#ifdef EFABUS_FI_LIBRARY_DIR
	*opened = EFABUS_FI_LIBRARY_DIR "/" FI_LIBRARY;
	handle = try_open(*opened, RTLD_NOW | RTLD_LOCAL);
	if (handle)
		return handle;
	*opened = FI_LIBRARY;
#endif
	return try_open(FI_LIBRARY, RTLD_NOW | RTLD_LOCAL);
}

static void *symbol(void *handle, const char *opened, const char *name,
		    const char *version)
{
	void *found = dlvsym(handle, name, version);

	if (!found && !lib_error[0])
		snprintf(lib_error, sizeof(lib_error),
			 "%s has no %s of symbol version %s: it is older than "
			 "the libfabric %d.%d efabus was built with",
			 opened, name, version, FI_MAJOR_VERSION,
			 FI_MINOR_VERSION);
	return found;
}

/*
 * Libraries libfabric pulls in (psm's) install handlers for SIGINT,
 * SIGTERM, SIGSEGV and others as they load; the process keeps the
 * dispositions it had, so that its own handlers (and Rust's stack overflow
 * report) are not replaced by a library it loaded later. (A handler that
 * another thread installs while the library loads is put back too.)
 */
static void load_library(void)
{
	struct sigaction before[64];
	int saved[64] = { 0 };
	int last = SIGRTMIN < 64 ? SIGRTMIN : 64;
	const char *opened;
	void *handle;
	int sig;

	for (sig = 1; sig < last; sig++)
		saved[sig] = sig != SIGKILL && sig != SIGSTOP &&
			     sigaction(sig, NULL, &before[sig]) == 0;
	handle = open_library(&opened);
	for (sig = 1; sig < last; sig++) {
		struct sigaction now;

		if (!saved[sig] || sigaction(sig, NULL, &now) != 0)
			continue;
		if (now.sa_handler != before[sig].sa_handler ||
		    now.sa_flags != before[sig].sa_flags)
			sigaction(sig, &before[sig], NULL);
	}
	if (!handle) {
		lib_failure = EFABUS_FI_NOT_FOUND;
		return;
	}
	lib_error[0] = '\0'; /* what failed before the file that opened */

	lib.getinfo = symbol(handle, opened, "fi_getinfo", EFABUS_FI_INFO_ABI);
	lib.freeinfo = symbol(handle, opened, "fi_freeinfo", EFABUS_FI_INFO_ABI);
	lib.dupinfo = symbol(handle, opened, "fi_dupinfo", EFABUS_FI_INFO_ABI);
	lib.fabric = symbol(handle, opened, "fi_fabric", "FABRIC_1.1");
	lib.strerror = symbol(handle, opened, "fi_strerror", "FABRIC_1.0");
	lib.tostr_r = symbol(handle, opened, "fi_tostr_r", "FABRIC_1.4");
	lib.version = symbol(handle, opened, "fi_version", "FABRIC_1.0");
	if (lib_error[0]) {
		/* Kept loaded: its constructors ran, and may have left threads. */
		memset(&lib, 0, sizeof(lib));
		lib_failure = EFABUS_FI_TOO_OLD;
		return;
	}
	__atomic_store_n(&lib_ready, 1, __ATOMIC_RELEASE);
}

int efabus_fi_is_loaded(void)
{
	return __atomic_load_n(&lib_ready, __ATOMIC_ACQUIRE);
}

int efabus_fi_load(void)
{
	pthread_once(&lib_once, load_library);
	return lib_failure;
}

const char *efabus_fi_load_error(void)
{
	return lib_error;
}
#else
#define FI(name) fi_##name

int efabus_fi_load(void)
{
	return 0;
}

int efabus_fi_is_loaded(void)
{
	return 1;
}

const char *efabus_fi_load_error(void)
{
	return "";
}
#endif

/*
 * FI_OPT_EFA_RNR_RETRY is an enum value (so #ifdef cannot see it) in
 * fi_ext.h on 1.x and in fi_ext_efa.h on later releases; its value is
 * fixed by the provider-specific option scheme, so spell it out and check
 * it against the header where the header names the base.
 */
#define EFABUS_OPT_EFA_RNR_RETRY (-(0xefa << 16))
#ifdef FI_PROV_SPECIFIC_EFA
_Static_assert(EFABUS_OPT_EFA_RNR_RETRY == -FI_PROV_SPECIFIC_EFA,
	       "FI_OPT_EFA_RNR_RETRY moved");
#endif

#define C(name) { #name, (uint64_t)(name) }
static const struct efabus_constant constants[] = {
	C(FI_MSG), C(FI_RMA), C(FI_READ), C(FI_REMOTE_READ),
	C(FI_RECV), C(FI_SEND), C(FI_TRANSMIT), C(FI_MULTI_RECV),
	C(FI_SOURCE), C(FI_CONTEXT), C(FI_MSG_PREFIX), C(FI_CONTEXT2),
	C(FI_MR_LOCAL), C(FI_MR_VIRT_ADDR), C(FI_MR_ALLOCATED), C(FI_MR_PROV_KEY),
	C(FI_MR_ENDPOINT), C(FI_MR_HMEM), C(FI_ORDER_SAS), C(FI_EP_UNSPEC),
	C(FI_EP_MSG), C(FI_EP_DGRAM), C(FI_EP_RDM), C(FI_EP_SOCK_STREAM),
	C(FI_EP_SOCK_DGRAM), C(FI_FORMAT_UNSPEC), C(FI_SOCKADDR), C(FI_SOCKADDR_IN),
	C(FI_SOCKADDR_IN6), C(FI_ADDR_STR), C(FI_ADDR_EFA), C(FI_THREAD_DOMAIN),
	C(FI_AV_TABLE), C(FI_ADDR_UNSPEC), C(FI_ADDR_NOTAVAIL), C(FI_SUCCESS),
	C(FI_EAGAIN), C(FI_EAVAIL), C(FI_ENODATA), C(FI_ENOSYS),
	C(FI_EOPNOTSUPP), C(FI_ECANCELED), C(FI_ETRUNC), C(FI_ENOMEM),
	C(FI_EINVAL), C(FI_ENOPROTOOPT), C(FI_EBUSY), C(FI_ENORX), C(FI_ENOKEY),
	{ "FI_OPT_EFA_RNR_RETRY", (uint64_t)(int64_t)EFABUS_OPT_EFA_RNR_RETRY },
	{ "EFABUS_FI_VERSION", EFABUS_FI_VERSION },
};
#undef C

const struct efabus_constant *efabus_constants(size_t *count)
{
	*count = sizeof(constants) / sizeof(constants[0]);
	return constants;
}

uint32_t efabus_runtime_version(void)
{
	return efabus_fi_load() ? 0 : FI(version)();
}

uint32_t efabus_header_version(void)
{
	return FI_VERSION(FI_MAJOR_VERSION, FI_MINOR_VERSION);
}

/* NULL also when libfabric is inside the program (a static link). */
const char *efabus_fi_loaded_from(void)
{
	Dl_info where, program;

	if (efabus_fi_load() || !dladdr((void *)FI(getinfo), &where) ||
	    !dladdr((void *)efabus_fi_loaded_from, &program) ||
	    where.dli_fbase == program.dli_fbase)
		return NULL;
	return where.dli_fname;
}

uint32_t efabus_requested_version(void)
{
	return EFABUS_FI_VERSION;
}

const char *efabus_strerror(int err)
{
	return efabus_fi_load() ? NULL : FI(strerror)(err);
}

/* Replaces a string owned by an fi_info (freed by fi_freeinfo). */
static int set_string(char **slot, const char *value)
{
	if (!value)
		return 0;
	free(*slot);
	*slot = strdup(value);
	return *slot ? 0 : -FI_ENOMEM;
}

int efabus_getinfo(const char *node, const char *service, uint64_t flags,
		   const struct efabus_hints *h, struct fi_info **info)
{
	struct fi_info *hints;
	int ret;

	*info = NULL;
	if (efabus_fi_load())
		return -FI_ENOSYS;
	hints = FI(dupinfo)(NULL); /* fi_allocinfo(), which is inline */
	if (!hints)
		return -FI_ENOMEM;

	hints->caps = h->caps;
	hints->mode = h->mode;
	hints->addr_format = (uint32_t)h->addr_format;
	hints->ep_attr->type = (enum fi_ep_type)h->ep_type;
	hints->tx_attr->msg_order = h->tx_msg_order;
	hints->rx_attr->msg_order = h->rx_msg_order;
	hints->domain_attr->mr_mode = (int)h->mr_mode;
	hints->domain_attr->mode = h->domain_mode;
	hints->domain_attr->threading = (enum fi_threading)h->threading;
	hints->domain_attr->av_type = (enum fi_av_type)h->av_type;
	ret = set_string(&hints->fabric_attr->prov_name, h->prov_name);
	if (!ret)
		ret = set_string(&hints->domain_attr->name, h->domain_name);
	if (!ret)
		ret = set_string(&hints->fabric_attr->name, h->fabric_name);
	if (!ret)
		ret = FI(getinfo)(EFABUS_FI_VERSION, node, service, flags, hints, info);
	FI(freeinfo)(hints);
	return ret;
}

void efabus_freeinfo(struct fi_info *info)
{
	FI(freeinfo)(info);
}

struct fi_info *efabus_info_next(const struct fi_info *info)
{
	return info->next;
}

struct fi_info *efabus_dupinfo(const struct fi_info *info)
{
	return FI(dupinfo)(info);
}

void efabus_info_view(const struct fi_info *info, struct efabus_info_view *v)
{
	memset(v, 0, sizeof(*v));
	v->caps = info->caps;
	v->mode = info->mode;
	v->addr_format = info->addr_format;
	v->src_addrlen = info->src_addrlen;
	v->dest_addrlen = info->dest_addrlen;
	v->src_addr = info->src_addr;
	v->dest_addr = info->dest_addr;
	v->handle = info->handle;

	if (info->tx_attr) {
		const struct fi_tx_attr *a = info->tx_attr;
		v->has_tx = 1;
		v->tx_caps = a->caps;
		v->tx_mode = a->mode;
		v->tx_op_flags = a->op_flags;
		v->tx_msg_order = a->msg_order;
		v->tx_comp_order = a->comp_order;
		v->tx_inject_size = a->inject_size;
		v->tx_size = a->size;
		v->tx_iov_limit = a->iov_limit;
		v->tx_rma_iov_limit = a->rma_iov_limit;
		v->tx_tclass = a->tclass;
	}
	if (info->rx_attr) {
		const struct fi_rx_attr *a = info->rx_attr;
		v->has_rx = 1;
		v->rx_caps = a->caps;
		v->rx_mode = a->mode;
		v->rx_op_flags = a->op_flags;
		v->rx_msg_order = a->msg_order;
		v->rx_comp_order = a->comp_order;
		v->rx_total_buffered_recv = a->total_buffered_recv;
		v->rx_size = a->size;
		v->rx_iov_limit = a->iov_limit;
	}
	if (info->ep_attr) {
		const struct fi_ep_attr *a = info->ep_attr;
		v->has_ep = 1;
		v->ep_type = a->type;
		v->ep_protocol = a->protocol;
		v->ep_protocol_version = a->protocol_version;
		v->ep_max_msg_size = a->max_msg_size;
		v->ep_msg_prefix_size = a->msg_prefix_size;
		v->ep_max_order_raw_size = a->max_order_raw_size;
		v->ep_max_order_war_size = a->max_order_war_size;
		v->ep_max_order_waw_size = a->max_order_waw_size;
		v->ep_mem_tag_format = a->mem_tag_format;
		v->ep_tx_ctx_cnt = a->tx_ctx_cnt;
		v->ep_rx_ctx_cnt = a->rx_ctx_cnt;
		v->ep_auth_key_size = a->auth_key_size;
	}
	if (info->domain_attr) {
		const struct fi_domain_attr *a = info->domain_attr;
		v->has_domain = 1;
		v->dom_domain = a->domain;
		v->dom_name = a->name;
		v->dom_threading = a->threading;
		v->dom_control_progress = a->control_progress;
		v->dom_data_progress = a->data_progress;
		v->dom_resource_mgmt = a->resource_mgmt;
		v->dom_av_type = a->av_type;
		v->dom_mr_mode = (uint64_t)(unsigned int)a->mr_mode;
		v->dom_mr_key_size = a->mr_key_size;
		v->dom_cq_data_size = a->cq_data_size;
		v->dom_cq_cnt = a->cq_cnt;
		v->dom_ep_cnt = a->ep_cnt;
		v->dom_tx_ctx_cnt = a->tx_ctx_cnt;
		v->dom_rx_ctx_cnt = a->rx_ctx_cnt;
		v->dom_max_ep_tx_ctx = a->max_ep_tx_ctx;
		v->dom_max_ep_rx_ctx = a->max_ep_rx_ctx;
		v->dom_max_ep_stx_ctx = a->max_ep_stx_ctx;
		v->dom_max_ep_srx_ctx = a->max_ep_srx_ctx;
		v->dom_cntr_cnt = a->cntr_cnt;
		v->dom_mr_iov_limit = a->mr_iov_limit;
		v->dom_caps = a->caps;
		v->dom_mode = a->mode;
		v->dom_auth_key_size = a->auth_key_size;
		v->dom_max_err_data = a->max_err_data;
		v->dom_mr_cnt = a->mr_cnt;
		v->dom_tclass = a->tclass;
	}
	if (info->fabric_attr) {
		const struct fi_fabric_attr *a = info->fabric_attr;
		v->has_fabric = 1;
		v->fab_name = a->name;
		v->fab_prov_name = a->prov_name;
		v->fab_prov_version = a->prov_version;
		v->fab_api_version = a->api_version;
	}
	if (info->nic) {
		const struct fid_nic *n = info->nic;
		v->has_nic = 1;
		if (n->device_attr) {
			v->has_device = 1;
			v->dev_name = n->device_attr->name;
			v->dev_device_id = n->device_attr->device_id;
			v->dev_device_version = n->device_attr->device_version;
			v->dev_vendor_id = n->device_attr->vendor_id;
			v->dev_driver = n->device_attr->driver;
			v->dev_firmware = n->device_attr->firmware;
		}
		if (n->bus_attr) {
			v->has_bus = 1;
			v->bus_type = n->bus_attr->bus_type;
			v->pci_domain_id = n->bus_attr->attr.pci.domain_id;
			v->pci_bus_id = n->bus_attr->attr.pci.bus_id;
			v->pci_device_id = n->bus_attr->attr.pci.device_id;
			v->pci_function_id = n->bus_attr->attr.pci.function_id;
		}
		if (n->link_attr) {
			v->has_link = 1;
			v->link_address = n->link_attr->address;
			v->link_mtu = n->link_attr->mtu;
			v->link_speed = n->link_attr->speed;
			v->link_state = n->link_attr->state;
			v->link_network_type = n->link_attr->network_type;
		}
	}
}

size_t efabus_info_tostr(const struct fi_info *info, char *buf, size_t len)
{
	if (!len)
		return 0;
	buf[0] = '\0';
	FI(tostr_r)(buf, len, info, FI_TYPE_INFO);
	return strnlen(buf, len);
}

int efabus_fabric(const struct fi_info *info, struct fid_fabric **fabric)
{
	return FI(fabric)(info->fabric_attr, fabric, NULL);
}

int efabus_fabric_close(struct fid_fabric *fabric)
{
	return fi_close(&fabric->fid);
}

int efabus_domain(struct fid_fabric *fabric, struct fi_info *info,
		  struct fid_domain **domain)
{
	return fi_domain(fabric, info, domain, NULL);
}

int efabus_domain_close(struct fid_domain *domain)
{
	return fi_close(&domain->fid);
}

int efabus_av_open(struct fid_domain *domain, uint64_t type, uint64_t count,
		   struct fid_av **av)
{
	struct fi_av_attr attr;

	memset(&attr, 0, sizeof(attr));
	attr.type = (enum fi_av_type)type;
	attr.count = count;
	return fi_av_open(domain, &attr, av, NULL);
}

int efabus_av_close(struct fid_av *av)
{
	return fi_close(&av->fid);
}

int efabus_av_insert(struct fid_av *av, const void *addr, uint64_t *fi_addr)
{
	fi_addr_t out = FI_ADDR_NOTAVAIL;
	int ret = fi_av_insert(av, addr, 1, &out, 0, NULL);

	*fi_addr = out;
	return ret;
}

int efabus_av_remove(struct fid_av *av, uint64_t fi_addr)
{
	fi_addr_t addr = fi_addr;

	return fi_av_remove(av, &addr, 1, 0);
}

int efabus_wait_open(struct fid_fabric *fabric, struct fid_wait **wait)
{
	struct fi_wait_attr attr;

	memset(&attr, 0, sizeof(attr));
	attr.wait_obj = FI_WAIT_FD;
	return fi_wait_open(fabric, &attr, wait);
}

int efabus_wait_fd(struct fid_wait *wait, int *fd)
{
	return fi_control(&wait->fid, FI_GETWAIT, fd);
}

int efabus_wait_close(struct fid_wait *wait)
{
	return fi_close(&wait->fid);
}

int efabus_trywait(struct fid_fabric *fabric, struct fid_wait *wait)
{
	struct fid *fids[1] = { &wait->fid };

	return fi_trywait(fabric, fids, 1);
}

int efabus_cq_open(struct fid_domain *domain, uint64_t size, struct fid_wait *wait,
		   struct fid_cq **cq)
{
	struct fi_cq_attr attr;

	memset(&attr, 0, sizeof(attr));
	attr.size = size;
	attr.format = FI_CQ_FORMAT_DATA;
	if (wait) {
		attr.wait_obj = FI_WAIT_SET;
		attr.wait_set = wait;
	} else {
		attr.wait_obj = FI_WAIT_NONE;
	}
	return fi_cq_open(domain, &attr, cq, NULL);
}

int efabus_cq_close(struct fid_cq *cq)
{
	return fi_close(&cq->fid);
}

_Static_assert(sizeof(struct efabus_completion) == sizeof(struct fi_cq_data_entry),
	       "completion layout");
_Static_assert(offsetof(struct efabus_completion, len) ==
	       offsetof(struct fi_cq_data_entry, len), "completion layout");
_Static_assert(offsetof(struct efabus_completion, buf) ==
	       offsetof(struct fi_cq_data_entry, buf), "completion layout");

int64_t efabus_cq_read(struct fid_cq *cq, struct efabus_completion *buf, uint64_t count)
{
	return fi_cq_read(cq, buf, count);
}

int64_t efabus_cq_readfrom(struct fid_cq *cq, struct efabus_completion *buf, uint64_t count,
			   uint64_t *src_addr)
{
	return fi_cq_readfrom(cq, buf, count, (fi_addr_t *)src_addr);
}

int64_t efabus_cq_readerr(struct fid_cq *cq, struct efabus_cq_error *out)
{
	/*
	 * Room to spare behind the 1.x entry: later releases append fields,
	 * and a provider must not be able to write past our buffer.
	 */
	union {
		struct fi_cq_err_entry entry;
		char spare[sizeof(struct fi_cq_err_entry) + 256];
	} e;
	const char *text;
	ssize_t ret;

	memset(&e, 0, sizeof(e));
	memset(out, 0, sizeof(*out));
	ret = fi_cq_readerr(cq, &e.entry, 0);
	if (ret <= 0)
		return ret;
	out->op_context = e.entry.op_context;
	out->flags = e.entry.flags;
	out->len = e.entry.len;
	out->olen = e.entry.olen;
	out->err = e.entry.err;
	out->prov_errno = e.entry.prov_errno;
	text = fi_cq_strerror(cq, e.entry.prov_errno, e.entry.err_data,
			      out->prov_text, sizeof(out->prov_text));
	if (text && text != out->prov_text) {
		strncpy(out->prov_text, text, sizeof(out->prov_text) - 1);
		out->prov_text[sizeof(out->prov_text) - 1] = '\0';
	}
	return ret;
}

int efabus_endpoint(struct fid_domain *domain, struct fi_info *info,
		    struct fid_ep **ep)
{
	return fi_endpoint(domain, info, ep, NULL);
}

int efabus_ep_close(struct fid_ep *ep)
{
	return fi_close(&ep->fid);
}

int efabus_ep_bind_av(struct fid_ep *ep, struct fid_av *av)
{
	return fi_ep_bind(ep, &av->fid, 0);
}

int efabus_ep_bind_cq(struct fid_ep *ep, struct fid_cq *cq, uint64_t flags)
{
	return fi_ep_bind(ep, &cq->fid, flags);
}

int efabus_ep_set_efa_rnr_retry(struct fid_ep *ep, uint64_t retry)
{
	size_t value = (size_t)retry;

	return fi_setopt(&ep->fid, FI_OPT_ENDPOINT, EFABUS_OPT_EFA_RNR_RETRY,
			 &value, sizeof(value));
}

int efabus_enable(struct fid_ep *ep)
{
	return fi_enable(ep);
}

int efabus_getname(struct fid_ep *ep, void *addr, uint64_t *addrlen)
{
	size_t len = (size_t)*addrlen;
	int ret = fi_getname(&ep->fid, addr, &len);

	*addrlen = len;
	return ret;
}

int efabus_mr_reg(struct fid_domain *domain, const void *buf, uint64_t len,
		  uint64_t access, uint64_t requested_key, struct fid_mr **mr)
{
	return fi_mr_reg(domain, buf, len, access, 0, requested_key, 0, mr, NULL);
}

int efabus_mr_close(struct fid_mr *mr)
{
	return fi_close(&mr->fid);
}

void *efabus_mr_desc(struct fid_mr *mr)
{
	return fi_mr_desc(mr);
}

uint64_t efabus_mr_key(struct fid_mr *mr)
{
	return fi_mr_key(mr);
}

int64_t efabus_recv(struct fid_ep *ep, void *buf, uint64_t len, void *desc,
		    void *context)
{
	return fi_recv(ep, buf, len, desc, FI_ADDR_UNSPEC, context);
}

int64_t efabus_recv_multi(struct fid_ep *ep, void *buf, uint64_t len, void *desc,
			  void *context)
{
	struct iovec iov = { .iov_base = buf, .iov_len = len };
	struct fi_msg msg = {
		.msg_iov = &iov,
		.desc = &desc,
		.iov_count = 1,
		.addr = FI_ADDR_UNSPEC,
		.context = context,
	};

	return fi_recvmsg(ep, &msg, FI_MULTI_RECV);
}

int efabus_ep_set_min_multi_recv(struct fid_ep *ep, uint64_t min)
{
	size_t value = (size_t)min;

	return fi_setopt(&ep->fid, FI_OPT_ENDPOINT, FI_OPT_MIN_MULTI_RECV, &value,
			 sizeof(value));
}

int64_t efabus_send(struct fid_ep *ep, const void *buf, uint64_t len, void *desc,
		    uint64_t dest, void *context)
{
	return fi_send(ep, buf, len, desc, dest, context);
}

int64_t efabus_read(struct fid_ep *ep, void *buf, uint64_t len, void *desc,
		    uint64_t src, uint64_t addr, uint64_t key, void *context)
{
	return fi_read(ep, buf, len, desc, src, addr, key, context);
}

int64_t efabus_inject(struct fid_ep *ep, const void *buf, uint64_t len,
		      uint64_t dest)
{
	return fi_inject(ep, buf, len, dest);
}

int64_t efabus_send2(struct fid_ep *ep, const void *buf0, uint64_t len0,
		     void *desc0, const void *buf1, uint64_t len1, void *desc1,
		     uint64_t dest, void *context)
{
	struct iovec iov[2] = {
		{ .iov_base = (void *)buf0, .iov_len = len0 },
		{ .iov_base = (void *)buf1, .iov_len = len1 },
	};
	void *desc[2] = { desc0, desc1 };

	return fi_sendv(ep, iov, desc, 2, dest, context);
}

/*
 * libfabric's own dependencies (psm, infinipath) install handlers for
 * SIGINT and SIGTERM when the library is loaded, and those handlers end the
 * process at once. An application that wants a graceful shutdown on these
 * signals puts the default disposition back first, then installs its own.
 * Returns 1 when a handler was removed, 0 when there was none, -1 on error.
 */
static int reset_inherited_signal(int sig)
{
	struct sigaction current;
	struct sigaction dfl;

	if (sigaction(sig, NULL, &current) != 0)
		return -1;
	if (!(current.sa_flags & SA_SIGINFO) &&
	    (current.sa_handler == SIG_DFL || current.sa_handler == SIG_IGN))
		return 0;
	memset(&dfl, 0, sizeof(dfl));
	dfl.sa_handler = SIG_DFL;
	sigemptyset(&dfl.sa_mask);
	return sigaction(sig, &dfl, NULL) == 0 ? 1 : -1;
}

void efabus_exit_at_once(int status)
{
	_exit(status);
}

int efabus_reset_termination_signals(void)
{
	int interrupt = reset_inherited_signal(SIGINT);
	int terminate = reset_inherited_signal(SIGTERM);

	if (interrupt < 0 || terminate < 0)
		return -1;
	return interrupt + terminate;
}
