"""Paraphrased questions for bench/bench_compress.py: questions that do not quote their answer sentence.

The template questions of bench/compress_data.py quote their sentence (cloze) or two thirds of it ("which section"),
so every query-aware retriever finds it. These two generators (seeded, offline) do not:

- "context" (the sentence is asked about through its surroundings): the gold sentence holds the answer span (a
  number, a dotted section number, a section reference's number or a quoted term); the question is worded with its
  section heading and with the content words of the sentences before and after it in the same section that the
  gold sentence does not contain: "In the part on <heading>, between what is said about <previous> and about
  <next>, which <number|term> is given?". The answer is in a sentence the question only points at.
- "paraphrase" (the sentence's own meaning in other words): the gold sentence's content words, the answer removed,
  each replaced through a synonym table written for these corpora (SYNONYMS_EN, SYNONYMS_ZH below; no thesaurus
  data ships in the registries in a form usable offline); a word without an entry is dropped with probability 1/2,
  the rest kept: "Which <number|term> applies to: <words>?".

Each generator's questions alternate tune / held-out in their (seeded) order, so both splits have the same mix.
`cue_words` are the question's content words without its template shell: the overlap figures of the bench
(share of them found in the gold sentence, BM25 rank of the gold sentence) are computed on them.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from glmserve.compress.bm25 import words
from glmserve.compress.segment import Unit

_ANSWER = re.compile(r"\b\d+(?:\.\d+)+\b|\b\d{2,}\b|(?<=[Ss]ection )\d\b|\"[^\"\n]{2,30}\"|“[^”\n]{2,20}”")

SYNONYMS_EN = dict(pair.split("=") for pair in """
package=bundle packages=bundles should=ought files=documents file=document version=release versions=releases
source=origin system=platform use=employ used=employed binary=compiled control=governing library=lib shared=common
scripts=programs script=program installed=set-up information=details maintainer=packager maintainers=packagers
policy=rules example=instance new=fresh same=identical changes=modifications change=modify configuration=settings
name=identifier names=identifiers build=compile directory=folder directories=folders list=enumeration
required=mandatory fields=entries field=entry dependencies=prerequisites dependency=prerequisite
upstream=original-author need=require section=chapter format=layout manual=handbook programs=applications
program=application run=execute user=account archive=repository rules=regulations included=contained
removed=deleted released=published architecture=platform-type symbols=identifiers available=obtainable
first=initial include=contain instead=rather make=create set=define copyright=authorship line=row
install=set-up distribution=release-set without=lacking provide=supply number=count contain=hold value=setting
time=moment details=specifics default=standard create=make called=named support=handle normally=usually
recommended=advised contains=holds documentation=docs old=previous before=prior document=text possible=feasible
local=site described=explained installation=setup state=status virtual=abstract postinst=post-install-script
provides=supplies binaries=executables unpacked=extracted target=goal changelog=change-log built=compiled
priority=importance different=distinct configured=set-up software=code syntax=grammar packaging=bundling
necessary=needed release=publish note=remark directly=straight appropriate=suitable error=failure
building=compiling optional=elective particular=specific start=begin including=incl upgrade=update
license=licence done=performed work=operate requirements=conditions variable=parameter links=pointers
require=demand command=instruction mandatory=compulsory single=one code=source-text behavior=behaviour
allowed=permitted least=minimum except=save lines=rows several=various essential=vital symbolic=soft
changed=altered conflicts=clashes specified=stated must=has-to may=can executable=runnable
covered=governed terms=provisions convey=pass-on conveying=passing-on general=overall copy=duplicate
corresponding=matching free=libre object=compiled-form rights=entitlements apply=pertain warranty=guarantee
additional=extra patent=invention-right copies=duplicates modify=alter conditions=stipulations
modified=altered law=statute form=shape material=content product=item works=creations permission=consent
freedom=liberty receive=get received=got legal=lawful applicable=relevant propagate=spread parties=participants
notices=notifications permissions=authorizations charge=fee recipients=receivers offer=proposal making=producing
notice=notification further=more foundation=organization designed=intended authors=writers network=net
interface=surface modification=alteration based=founded give=grant reasonable=fair party=participant
permitted=allowed distribute=disseminate access=reach patents=invention-rights extent=degree regardless=irrespective
holder=owner certain=particular fee=charge install=deploy special=specific copying=duplicating requiring=demanding
propagation=spreading automatically=unaided stated=declared medium=carrier entire=whole written=authored
server=host recipient=receiver transaction=deal liability=responsibility licensors=grantors grant=award
permanently=forever acceptance=agreement contributor=participant later=subsequent verbatim=literal
remains=stays price=cost protect=guard developers=authors products=items provision=clause needed=required
proprietary=closed follow=obey refers=points licensed=permitted resulting=consequent unmodified=unaltered
infringement=violation prominent=noticeable modifications=alterations whole=entire specific=particular
""".split())

SYNONYMS_ZH = dict(pair.split("=") for pair in """
软件包=套件 文件=档案 使用=采用 可以=能够 命令=指令 如果=倘若 需要=要求 安装=部署 源代码=源码 程序=应用
目录=文件夹 上游=原作者 文档=文献 创建=建立 新=全新 版本=发行版 构建=编译 打包=封装 二进制=可执行 添加=加入
修改=更改 内容=材料 包含=含有 其他=别的 生成=产生 格式=样式 所有=全部 更新=升级 补丁=修补 执行=运行 编译=构建
已经=业已 源码=源代码 系统=平台 可能=或许 自动=自行 仓库=存储库 设置=配置 提供=给出 软件=程序 没有=缺少 问题=疑问
应该=应当 脚本=批处理 运行=执行 描述=说明 维护者=维护人 工具=工具软件 过程=流程 检查=核查 情况=状况 方法=办法
比如=例如 教程=指南 名称=名字 默认=缺省 上传=提交 通常=一般 按照=依照 存在=具有 用于=用来 手册=指南书 共享=公用
维护=维护工作 阅读=查阅 支持=兼容 必须=务必 目标=对象 规则=准则 变量=参数 选项=参数项 配置=设定 依赖=依存
""".split())


@dataclass(frozen=True)
class ParaQuestion:
    doc: str
    type: str  # "context" or "paraphrase"
    split: str  # "tune" or "held-out"
    query: str
    prompt: str
    gold: tuple[int, int]  # the gold sentence's source span
    answer: tuple[int, int]  # the answer span (inside the gold sentence)
    answer_text: str
    cue_words: tuple[str, ...]  # the question's content words, template shell left out


def _kind(answer: str, chinese: bool) -> str:
    if answer[0] in "\"“":
        return "术语" if chinese else "term"
    if "." in answer:
        return "节号" if chinese else "section number"
    return "数字" if chinese else "number"


def _answer(u: Unit) -> re.Match[str] | None:
    return _ANSWER.search(u.text)


def _title(heading: str) -> str:
    """The heading's title line without its number and underline."""
    lines = [ln for ln in heading.splitlines() if re.search(r"[A-Za-z\u4e00-\u9fff]{2}", ln)]
    title = " ".join(lines[0].split()) if lines else ""
    return re.sub(r"^[\s*#]*(?:\d+(?:\.\d+)*\.?|第\S+?[章节])\s*", "", title)[:80]


def _neighbour_words(text: str, exclude: set[str], answer: str, limit: int) -> list[str]:
    out: list[str] = []
    for w in words(text):
        if w not in exclude and w not in out and not any(c.isdigit() for c in w) and w not in answer.lower():
            out.append(w)
        if len(out) >= limit:
            break
    return out


def _context_question(units: list[Unit], i: int, heading: Unit | None, chinese: bool) -> ParaQuestion | None:
    u = units[i]
    m = _answer(u)
    if not m or i == 0 or i + 1 >= len(units):
        return None
    prev, nxt = units[i - 1], units[i + 1]
    if prev.heading or nxt.heading or prev.section != u.section or nxt.section != u.section:
        return None
    own = set(words(u.text))
    before = _neighbour_words(prev.text, own, m.group(0), 6)
    after = _neighbour_words(nxt.text, own, m.group(0), 6)
    if len(before) < 2 or len(after) < 2:
        return None
    head = _title(heading.text) if heading is not None else ""
    kind = _kind(m.group(0), chinese)
    if chinese:
        where = f"在“{head}”一部分中，" if head else ""
        query = f"{where}介于讲“{'、'.join(before)}”的一句和讲“{'、'.join(after)}”的一句之间，给出的{kind}是什么？"
    else:
        where = f"In the part on {head}, " if head else ""
        query = (f"{where}between what is said about {', '.join(before)} and about {', '.join(after)}, "
                 f"which {kind} is given?")
    cues = tuple(words(head)) + tuple(before) + tuple(after)
    return ParaQuestion(u.doc, "context", "", query, query, (u.start, u.end),
                        (u.start + m.start(), u.start + m.end()), m.group(0), cues)


def _paraphrase_question(u: Unit, chinese: bool, rng: random.Random) -> ParaQuestion | None:
    m = _answer(u)
    if not m:
        return None
    table = SYNONYMS_ZH if chinese else SYNONYMS_EN
    rest = u.text[:m.start()] + " " + u.text[m.end():]
    out: list[str] = []
    replaced = 0
    for w in dict.fromkeys(words(rest)):
        if w.isdigit():
            continue
        if w in table:
            out.append(table[w].replace("-", " "))
            replaced += 1
        elif rng.random() < 0.5:
            out.append(w)
    if replaced < 2 or len(out) < 4:
        return None
    kind = _kind(m.group(0), chinese)
    query = f"关于“{'、'.join(out)}”，适用的{kind}是什么？" if chinese else f"Which {kind} applies to: {' '.join(out)}?"
    cues = tuple(t for w in out for t in words(w))
    return ParaQuestion(u.doc, "paraphrase", "", query, query, (u.start, u.end),
                        (u.start + m.start(), u.start + m.end()), m.group(0), cues)


def make_paraphrased(units: list[Unit], n: int, chinese: bool = False, seed: int = 0) -> list[ParaQuestion]:
    """About `n` questions over one document's units: half "context", half "paraphrase", each half split
    alternately into tune and held-out; a sentence is asked about at most once by each generator."""
    lo, hi = (15, 200) if chinese else (30, 400)
    heading_of: list[Unit | None] = []
    current: Unit | None = None
    for u in units:
        if u.heading:
            current = u
        heading_of.append(current if current is not None and current.section == u.section else None)
    pool = [i for i, u in enumerate(units) if not u.heading and lo <= len(u.text) <= hi]
    rng = random.Random(seed)
    rng.shuffle(pool)
    out: list[ParaQuestion] = []
    for kind in ("context", "paraphrase"):
        made: list[ParaQuestion] = []
        for i in pool:
            if len(made) >= n // 2:
                break
            q = (_context_question(units, i, heading_of[i], chinese) if kind == "context"
                 else _paraphrase_question(units[i], chinese, rng))
            if q is not None:
                made.append(q)
        out.extend(ParaQuestion(**{**q.__dict__, "split": ("tune", "held-out")[j % 2]}) for j, q in enumerate(made))
    return out
